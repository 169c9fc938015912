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
