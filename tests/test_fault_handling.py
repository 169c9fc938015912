"""The fault-tolerance pieces one by one (fast; the whole-run faults are in tests/test_faults.py):
``OAR_FAULTS`` parsing and filters, the hang watchdog's deadlines, dumps and exit status, the
preemption flag, and ``oar train`` refusing a bad config before it starts torchrun."""

from __future__ import annotations

import os
import re
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
from tests.distributed import launch

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


def test_stall_until_signal_ends_on_a_stop_signal_or_after_its_seconds(monkeypatch):
    """test_faults' Slurm case stalls a rank's generation until SIGUSR1 reaches it: the stall
    ends as the signal comes (the trainer's handler still records it), never before, and after
    ``seconds`` without one; the process's signal wake-up fd is left as it was."""
    import threading
    import time

    monkeypatch.setenv("RANK", "0")
    p = Preemption().install()
    try:
        for fault, signal_after, lasts in (("stall-until-signal@generate:seconds=30", 0.5, (0.5, 10)),
                                           ("stall-until-signal@generate:seconds=1", None, (1, 10))):
            monkeypatch.setenv(faults.ENV, fault)
            faults.reset()
            t = time.monotonic()  # before the timer starts: the stall lasts at least signal_after
            if signal_after is not None:
                threading.Timer(signal_after, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            faults.inject("generate", step=1)
            assert lasts[0] <= time.monotonic() - t < lasts[1], (fault, time.monotonic() - t)
            assert p.received == (None if signal_after is None else signal.SIGUSR1)
            p.received = None
        assert signal.set_wakeup_fd(-1) == -1
    finally:
        p.uninstall()
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


def test_watchdog_phase_with_its_own_limit(tmp_path):
    """The HF export at the end has its own deadline (checkpoint.convert_timeout_minutes), longer
    than the phase limit, and a dump naming that key when it passes it."""
    r = _watch(tmp_path, """
        with w.phase("export_hf", 9, limit=(2.0, "checkpoint.convert_timeout_minutes=0.0167 min")):
            time.sleep(1.3)            # past train.phase_timeout_s=1, within its own limit
        with w.phase("export_hf", 9, limit=(0.5, "checkpoint.convert_timeout_minutes=0.0083 min")):
            time.sleep(30)
    """)
    assert r.returncode == EXIT_HANG, r.stderr
    assert ("rank 3: phase 'export_hf' of step 9 ran past checkpoint.convert_timeout_minutes=0.0083 min "
            "(attempt 2)") in r.stderr


# ------------------------------------------------------------------------ rank 0 working alone
# The HF conversion at the start and the HF export at the end run on rank 0 while the others wait.
# In these worlds the default group's collectives time out after DEFAULT_TIMEOUT_S, standing in for
# NCCL's 30 minutes (parallel.timeout_minutes); rank 0's work takes SLOW_S, longer than that.

DEFAULT_TIMEOUT_S = 2.0
SLOW_S = 3.0


def _slow_converter(cmd, *, timeout, **_):
    """``subprocess.run`` of the HF -> megatron converter child, SLOW_S long (honouring ``timeout``
    as subprocess.run does); ``--dtype fail`` makes it fail at once."""
    import time

    from megatron_oar.models.model_checkpoint import META_FILE

    if "fail" in cmd:
        return subprocess.CompletedProcess(cmd, 1, "", "converter: no such dtype")
    time.sleep(min(SLOW_S, timeout))
    if SLOW_S > timeout:
        raise subprocess.TimeoutExpired(cmd, timeout)
    out = Path(cmd[cmd.index("--out") + 1])
    out.mkdir(parents=True)
    (out / META_FILE).write_text("{}")
    return subprocess.CompletedProcess(cmd, 0, "", "")


def _init_checkpoint_worker(tmp: str) -> None:
    import time
    from datetime import timedelta
    from unittest import mock

    import torch.distributed as dist

    from megatron_oar.training import policy

    dist.init_process_group("gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    rank, hf = dist.get_rank(), Path(tmp) / "hf"
    with mock.patch.object(policy.subprocess, "run", _slow_converter):
        t0 = time.monotonic()  # a sized timeout longer than rank 0's work: everyone waits it out
        out = policy.init_checkpoint(hf, Path(tmp) / "run1", "bf16", timeout_minutes=0.25)
        assert out == Path(tmp) / "run1" / policy.INIT_CHECKPOINT and time.monotonic() - t0 >= SLOW_S
        with pytest.raises(TimeoutError, match=r"checkpoint\.convert_timeout_minutes=0\.02 minutes"):
            policy.init_checkpoint(hf, Path(tmp) / "run2", "bf16", timeout_minutes=0.02)  # 1.2 s
        t0 = time.monotonic()  # rank 0 fails: every rank raises at once, naming the cause
        with pytest.raises(RuntimeError, match="no such dtype"):
            policy.init_checkpoint(hf, Path(tmp) / "run3", "fail", timeout_minutes=0.25)
        assert time.monotonic() - t0 < DEFAULT_TIMEOUT_S, rank


@pytest.mark.slow
def test_hf_conversion_waits_on_a_timeout_sized_for_it(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    launch(_init_checkpoint_worker, 2, str(tmp_path))


def _export_hf_worker(tmp: str) -> None:
    import time
    from datetime import timedelta
    from types import SimpleNamespace
    from unittest import mock

    import torch.distributed as dist

    from checkpoints_convert import convert
    from megatron_oar.training.trainer import Trainer
    from megatron_oar.training.watchdog import PhaseWatchdog

    def slow_export(checkpoint, out, **_):
        time.sleep(SLOW_S)
        out.mkdir()

    dist.init_process_group("gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    rank = dist.get_rank()
    # the watchdog's phase limit (1 s) is shorter than the export: it must not end the waiting ranks
    watchdog = PhaseWatchdog(1.0, rank=rank, dump_dir=Path(tmp) / "hangs")
    cfg = SimpleNamespace(run_dir=tmp, checkpoint=SimpleNamespace(convert_timeout_minutes=0.25))
    trainer = SimpleNamespace(cfg=cfg, step=7, rank=rank, watchdog=watchdog)
    try:
        with watchdog.phase("checkpoint", 7):  # the last save: "after checkpoint" is armed now
            pass
        with mock.patch.object(convert, "megatron_to_hf", slow_export):
            out = Trainer.export_hf(trainer, Path(tmp) / "checkpoints" / "step_00000007")
        assert out == Path(tmp) / "hf" / "step_00000007" and out.is_dir()
    finally:
        watchdog.close()


@pytest.mark.slow
def test_hf_export_waits_past_the_phase_limit(tmp_path):
    launch(_export_hf_worker, 2, str(tmp_path))


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


@pytest.mark.slow
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


def test_oar_train_validates_the_config_for_its_world_before_torchrun(capsys, monkeypatch):
    """Issue 53: TP 2 left in the file, 2 processes of which rollout.ranks=1 serve rollouts: one
    training rank cannot hold TP 2. One line, exit 2, torchrun never started."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("torchrun was started"))
    rc = cli.main(["train", "--config", str(ROOT / "examples" / "tiny_chain_cpu.yaml"), "--nproc-per-node",
                   "2", "rollout.placement=separate", "rollout.ranks=1"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.splitlines() == [
        "config error: parallel.tp*parallel.pp = 2*1 does not divide the training ranks 1"
        + captured.err.splitlines()[0].split("training ranks 1", 1)[1]], captured.err


_EXIT_WITH = """
import os, sys, time
with open(sys.argv[1], "a") as f:  # one line per start of a rank
    f.write(os.environ["RANK"] + "\\n")
if os.environ["RANK"] == "1":  # a rank slower to fail: the agent stops it (its "closing signal" record)
    time.sleep(float(sys.argv[3]))
sys.exit(int(sys.argv[2]))
"""


def _torchrun(tmp_path, code: int, slow_s: float = 0.0) -> tuple[subprocess.CompletedProcess, int]:
    script, starts = tmp_path / "rank.py", tmp_path / f"starts{code}_{slow_s}"
    script.write_text(_EXIT_WITH)
    r = subprocess.run([sys.executable, "-m", "megatron_oar.commands.torchrun", "--standalone",
                        "--nproc-per-node=2", "--max-restarts=2", "--monitor-interval=0.1", str(script),
                        str(starts), str(code), str(slow_s)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return r, len(starts.read_text().split())


@pytest.mark.slow
def test_torchrun_never_restarts_a_config_error(tmp_path):
    """commands/torchrun.py: a rank that exits 2 (a config error) stops the group at once, with
    one line and exit 2 instead of torchrun's restarts and ChildFailedError report; any other
    failure is restarted as torchrun does. Cost: three torchrun launches of trivial ranks (~15 s)."""
    # both ranks fail at once, or rank 1 much later (the agent then stops it: under load it
    # happened with the first too)
    for slow_s in (0.0, 30.0):
        r, starts = _torchrun(tmp_path, 2, slow_s)
        assert r.returncode == 2 and starts <= 2, (starts, r.stderr)  # 2 ranks, started once
        # one line: no restart, no ChildFailedError report, no torchrun "failed (exitcode: 2)"
        # record, no "closing signal" record for the rank stopped
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and re.fullmatch(r"oar train: stopped on the config error above \(rank "
                                                r"(0|1|0, 1) exited 2\); not restarted", lines[0]), r.stderr
    # (the agent stops the other rank once one failed: it may not have started its script)
    r, starts = _torchrun(tmp_path, 3)
    assert r.returncode == 1 and starts >= 3, (starts, r.stderr)  # the first start + 2 restarts
    assert "ChildFailedError" in r.stderr


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
    assert argv[1:6] == ["-m", "megatron_oar.commands.torchrun", "--standalone", "--nproc-per-node=2",
                         "--max-restarts=5"]
    assert env["PET_SIGNALS_TO_HANDLE"].endswith(",SIGUSR1") and env["PET_MAX_RESTARTS"] == "5"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
