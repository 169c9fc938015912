"""How a command's process ends (``megatron_oar/process_exit.py``): ``exit_after``
keeps ``main``'s exit status (an exception's too) and still runs ``atexit`` handlers, with the
heap frozen (so CPython's finalisation does not walk it) and nanobind's leak report (which the
frozen heap sets off) filtered out of stderr, every other line kept;
the entry points that torchrun and ``oar`` start end through it.

Cost: one single-process ``python`` per case, no world, no engine: about 20 s on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import atexit, gc, os, sys
    from megatron_oar.process_exit import exit_after

    out = open(sys.argv[1], "w")

    def at_exit():
        out.write(f"atexit frozen={gc.get_freeze_count()}\\n")
        out.close()

    atexit.register(at_exit)

    def after_the_filter():  # registered before exit_after's filter, so run after it
        os.write(2, b"late line\\n")
        os.write(2, b"nanobind: leaked 1 types!\\n - leaked type \\"x\\"\\n")

    atexit.register(after_the_filter)

    def main():
        out.write("main\\n")
        if sys.argv[2] == "raise":
            raise RuntimeError("boom")
        return None if sys.argv[2] == "none" else int(sys.argv[2])

    exit_after(main)
""")


@pytest.mark.parametrize(("how", "status"), [("3", 3), ("none", 0), ("raise", 1)])
def test_exit_after_keeps_the_status_and_runs_atexit_with_the_heap_frozen(tmp_path, how, status):
    out = tmp_path / "out.txt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), how], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "main" and lines[1].startswith("atexit frozen="), lines
    assert int(lines[1].split("=")[1]) > 1000, lines  # the heap was frozen before atexit ran
    assert ("RuntimeError: boom" in proc.stderr) == (how == "raise"), proc.stderr
    # stderr written once the filter is up still arrives, less nanobind's leak report
    assert "late line" in proc.stderr and "leaked" not in proc.stderr, proc.stderr


# registered first, so it runs last of the atexit handlers: after the entry point's own end
PROBE = textwrap.dedent("""
    import atexit, gc, runpy, sys
    atexit.register(lambda: print(f"frozen={gc.get_freeze_count()}", file=sys.stderr))
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize(("module", "argv"), [
    ("megatron_oar.commands.train", ["--config", "missing.yaml"]),        # each torchrun rank
    ("megatron_oar.cli", ["train", "--config", "missing.yaml"]),          # oar (one process)
])
def test_entry_points_end_through_exit_after(tmp_path, module, argv):
    proc = subprocess.run([sys.executable, "-c", PROBE, module, *argv], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr  # the config error's status, kept
    assert "missing.yaml" in proc.stderr, proc.stderr
    frozen = [line for line in proc.stderr.splitlines() if line.startswith("frozen=")]
    assert frozen and int(frozen[-1].split("=")[1]) > 1000, proc.stderr


# the server answers gc.get_freeze_count() through a method registered for this check
WRITER_MANAGER = textwrap.dedent("""
    import gc
    from multiprocessing.managers import SyncManager
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron_oar.models.model_checkpoint import _results_queue_dies_with_us

    SyncManager.register("freeze_count", callable=gc.get_freeze_count)
    _results_queue_dies_with_us()  # megatron's writer Manager, as the first save starts it
    print("frozen", filesystem_async._oar_manager.freeze_count()._getvalue())
""")


@pytest.mark.slow
def test_the_checkpoint_writers_manager_server_runs_with_its_heap_frozen():
    """A rank's exit joins that server (multiprocessing's atexit hook): its own exit must not
    walk the modules it imported either."""
    proc = subprocess.run([sys.executable, "-c", WRITER_MANAGER], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("frozen")[1]) > 1000, proc.stdout


@pytest.mark.slow
def test_a_command_ends_without_nanobind_leak_reports():
    """The frozen heap keeps triton's nanobind objects alive past the interpreter's end, and
    nanobind reports them as leaks ("nanobind: leaked N instances!" ...) unless its report is
    filtered out: ``oar plan --help`` (megatron-core imports triton) ends with its help only."""
    proc = subprocess.run([sys.executable, "-m", "megatron_oar.cli", "plan", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout, proc.stdout
    assert "leaked" not in proc.stderr and "nanobind" not in proc.stderr, proc.stderr[-3000:]
