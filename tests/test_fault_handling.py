"""The fault-tolerance pieces one by one (fast; the whole-run faults are in tests/test_faults.py):
``OAR_FAULTS`` parsing and filters, the hang watchdog's deadlines, dumps and exit status, the
preemption flag, and ``oar train`` refusing a bad config before it starts torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_oar import cli
from megatron_oar.testing import faults
from megatron_oar.training.preemption import Preemption
from megatron_oar.training.watchdog import EXIT_HANG

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------- OAR_FAULTS

def test_faults_parse_and_filter(monkeypatch):
    parsed = faults.parse("kill@update:step=3:rank=1, hang@generate , enospc@checkpoint.shards:attempt=1")
    assert [(f.action, f.point, f.when) for f in parsed] == [
        ("kill", "update", {"step": 3, "rank": 1}), ("hang", "generate", {}),
        ("enospc", "checkpoint.shards", {"attempt": 1})]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    kill, hang, enospc = parsed
    assert kill.matches("update", 3) and not kill.matches("update", 2) and not kill.matches("sync", 3)
    assert hang.matches("generate", 7) and not enospc.matches("checkpoint.shards", 1)  # attempt 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert enospc.matches("checkpoint.shards", 1) and not hang.matches("generate", 7)  # attempt 0 only


@pytest.mark.parametrize("text,message", [
    ("explode@update", "ACTION one of kill"),
    ("kill", "ACTION@POINT"),
    ("kill@update:step=x", "filter 'step=x'"),
    ("kill@update:node=1", "filter 'node=1'"),
])
def test_faults_refuse_malformed_entries(text, message):
    with pytest.raises(ValueError, match=message):
        faults.parse(text)


def test_injected_enospc_and_error(monkeypatch):
    monkeypatch.setenv(faults.ENV, "enospc@checkpoint.shards:step=2,error@sync.bucket")
    monkeypatch.setenv("RANK", "0")
    faults.reset()
    try:
        faults.inject("checkpoint.shards", step=1)  # another step: nothing
        with pytest.raises(OSError, match="No space left on device") as e:
            faults.inject("checkpoint.shards", step=2)
        assert e.value.errno == 28
        faults.inject("checkpoint.shards", step=2)  # fires once
        with pytest.raises(RuntimeError, match="injected error at sync.bucket"):
            faults.inject("sync.bucket")
    finally:
        monkeypatch.delenv(faults.ENV)
        faults.reset()


# ----------------------------------------------------------------------------------- watchdog

def _watch(tmp_path: Path, body: str, timeout: float = 1.0) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import time
        from megatron_oar.training.watchdog import PhaseWatchdog
        w = PhaseWatchdog({timeout}, rank=3, dump_dir={str(tmp_path)!r}, attempt=2)
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_watchdog_dumps_names_the_phase_and_exits(tmp_path):
    r = _watch(tmp_path, """
        with w.phase("update", 4):
            time.sleep(0.3)            # within the limit
        with w.phase("generate", 5):
            with w.phase("rewards", 5):  # nested: the outer deadline holds
                time.sleep(30)
    """)
    assert r.returncode == EXIT_HANG, r.stderr
    header = "rank 3: phase 'generate' of step 5 ran past train.phase_timeout_s=1 s (attempt 2)"
    assert header in r.stderr and "time.sleep(30)" not in r.stderr  # a stack, not the source
    assert 'File "<string>", line' in r.stderr  # the main thread's frame
    dump = (tmp_path / "attempt2_rank00003.txt").read_text()
    assert dump.startswith(header) and "Thread" in dump


def test_watchdog_watches_between_phases_and_stops_on_close(tmp_path):
    r = _watch(tmp_path, """
        with w.phase("update", 4):
            pass
        time.sleep(30)                  # stuck after the phase, e.g. in a collective
    """)
    assert r.returncode == EXIT_HANG
    assert "rank 3: phase 'after update' of step 4 ran past" in r.stderr
    r = _watch(tmp_path, """
        with w.phase("update", 4):
            pass
        w.close()
        time.sleep(2.5)
        print("done")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr


def test_watchdog_off(tmp_path):
    r = _watch(tmp_path, """
        with w.phase("update", 4):
            time.sleep(1.5)
        print("done")
    """, timeout=0)
    assert r.returncode == 0 and r.stdout.strip() == "done"


# --------------------------------------------------------------------------------- preemption

def test_preemption_records_signals_once():
    p = Preemption().install()
    try:
        assert not p.requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: still the first one recorded
        assert p.received == signal.SIGUSR1 and p.requested()
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not p._handle


_RANK_WITH_HELPERS = textwrap.dedent("""
    import os, signal, sys, time
    from megatron_oar.models.model_checkpoint import _results_queue_dies_with_us
    from megatron_oar.rewards.pool import VerifierPool
    from megatron_oar.runtime.stop_signals import start_resource_tracker_shielded
    from megatron_oar.training.preemption import Preemption
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from multiprocessing import resource_tracker

    preemption = Preemption().install()
    start_resource_tracker_shielded()  # as Trainer() does first
    pool = VerifierPool(num_workers=1, timeout_s=30.0)
    _results_queue_dies_with_us()  # megatron's writer Manager, as the first save starts it
    print("ready", flush=True)
    while preemption.received is None:
        time.sleep(0.05)
    time.sleep(1.0)  # what the group's signal does to the helpers has happened by now
    assert os.waitpid(resource_tracker._resource_tracker._pid, os.WNOHANG) == (0, 0), "tracker died"
    queue = filesystem_async._results_queue
    queue.put("still there")
    assert queue.get(timeout=10) == "still there"
    [result] = pool.map([("1", "1")])
    assert result.status == "ok" and pool.restarts == 0, (result, pool.restarts)
    pool.close()
    print("helpers alive", flush=True)
""")


def test_stop_signals_to_the_rank_group_leave_its_helpers_alive():
    """torchrun forwards SIGTERM / SIGUSR1 to each worker's whole process group (``os.killpg``):
    the rank records it and finishes its step, and the helpers it started (the resource
    tracker, the verifier pool's forkserver and worker, megatron's checkpoint-writer Manager)
    must live on to serve the rank's last checkpoint and scores (``runtime/stop_signals.py``).
    A subprocess of its own session stands in for the rank (about 8 s: megatron's import)."""
    proc = subprocess.Popen([sys.executable, "-c", _RANK_WITH_HELPERS], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "ready":
                os.killpg(proc.pid, signal.SIGUSR1)  # what torchrun's agent does with a forwarded
                os.killpg(proc.pid, signal.SIGTERM)  # signal; Slurm then sends SIGTERM
                break
        out = "".join(lines) + proc.stdout.read()
        assert proc.wait(timeout=120) == 0 and "helpers alive" in out, out[-3000:]
        assert "died unexpectedly" not in out, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -------------------------------------------------------------------------------- oar train

def test_oar_train_refuses_a_bad_config_before_torchrun(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("torchrun was started"))
    rc = cli.main(["train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--nproc-per-node",
                   "2", "train.stepz=3"])
    assert rc == 2 and "unknown key 'train.stepz'" in capsys.readouterr().err


def test_oar_train_starts_torchrun_with_the_restart_budget(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK" and not k.startswith(("PET_", "TORCH_"))}
    monkeypatch.setattr(os, "environ", env)  # what oar train sets stays in this copy
    started = {}

    def execv(path, argv):
        started["argv"] = argv
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--nproc-per-node",
                  "2", "launch.max_restarts=5", "launch.preemption_grace_s=300"])
    argv = started["argv"]
    assert argv[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                         "--max-restarts=5"]
    assert env["PET_SIGNALS_TO_HANDLE"].endswith(",SIGUSR1") and env["PET_MAX_RESTARTS"] == "5"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
