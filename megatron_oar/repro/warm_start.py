"""Processes for ``oar repro``'s runs, forked from one interpreter that imported the stack once.

Each run of the harness (training, the SFT start's conversion, the oracle) is a process of its
own: its own one-process torch.distributed world, environment, log file and exit status, so a
failed or killed run is reported and resumed like any command. Started as ``python -m MODULE``,
every one of them first imported torch, megatron-core, transformers and vLLM (5-10 s of CPU per
process on 2 cores, ~40 runs in the default grid). :class:`WarmStarter` spawns one server
process that imports :data:`PRELOAD` once with ``OMP_NUM_THREADS=1`` (so no OpenMP thread pool
exists to be forked), then forks each run from it: ``MODULE.main(argv)`` in a fresh child with
the run's environment and working directory, stdout and stderr appended to its log, the
interpreter's exit functions run at its end, and its exit status (``-N`` when signal N ended it)
returned to the caller. Runs may be started from several threads at once. ``oar repro`` uses
it only where CUDA is absent (``runner.run``): a fork of a process whose imports initialised
CUDA's driver cannot use CUDA.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path

# What every run imports; imported once, in the server (a run imports anything else itself).
PRELOAD = ("torch", "megatron.core", "transformers", "vllm", "megatron_oar.training.trainer",
           "megatron_oar.commands.train", "megatron_oar.eval.oracle", "checkpoints_convert.cli")


def _child(module: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """A run, in the forked child: ``module.main(argv)``'s return value is the exit status."""
    import atexit
    import importlib
    import sys

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, *argv]
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    try:
        sys.exit(importlib.import_module(module).main(argv))
    finally:
        atexit._run_exitfuncs()  # as the interpreter does at exit (a fork child ends in os._exit)


def _serve(conn, preload: tuple[str, ...]) -> None:
    """The server: imports ``preload``, then forks a child per request ``(id, module, argv,
    env, cwd, log)`` and answers ``(id, exit status)`` when it ends. ``None`` or a closed pipe ends
    it (children still running then are killed: their caller is gone)."""
    import importlib
    import multiprocessing as mp
    from multiprocessing.connection import wait

    os.environ["OMP_NUM_THREADS"] = "1"  # before torch: no OpenMP pool in the process we fork
    from megatron_oar.log_setup import quiet_backend_notices

    quiet_backend_notices()  # megatron's import-time notices, filtered as every command filters them
    for name in preload:
        importlib.import_module(name)
    fork = mp.get_context("fork")
    running: dict[int, tuple[int, object]] = {}  # sentinel -> (request id, process)
    while True:
        for ready in wait([conn, *running]):
            if ready is not conn:
                rid, proc = running.pop(ready)
                proc.join()
                conn.send((rid, proc.exitcode))
                continue
            try:
                job = conn.recv()
            except (EOFError, OSError):
                job = None
            if job is None:
                for _, proc in running.values():
                    proc.kill()
                    proc.join()
                return
            rid, *args = job
            proc = fork.Process(target=_child, args=tuple(args), name=f"oar-repro-run-{rid}")
            proc.start()
            running[proc.sentinel] = (rid, proc)


class WarmStarter:
    """One warm server; :meth:`run` starts a module's ``main`` as a forked process and waits for
    it. Use as a context manager (``close`` ends the server)."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self._preload = tuple(preload)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._next = 0
        self._proc = self._conn = None  # started by the first run: a resumed grid may need none

    def _start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self._preload), name="oar-repro-starter")
        self._proc.start()
        child.close()
        threading.Thread(target=self._read, name="oar-repro-starter-reader", daemon=True).start()

    def run(self, module: str, argv: list[str], *, env: dict[str, str], log: Path) -> int:
        """``python -m module *argv`` with environment ``env``, output appended to ``log``, in this
        process's working directory; returns its exit status."""
        fut: Future = Future()
        with self._lock:
            if self._proc is None:
                self._start()
            if not self._proc.is_alive():
                raise RuntimeError(f"the warm start server exited ({self._proc.exitcode})")
            self._next += 1
            self._pending[self._next] = fut
            self._conn.send((self._next, module, list(argv), dict(env), os.getcwd(), str(log)))
        return fut.result()

    def _read(self) -> None:
        try:
            while True:
                rid, rc = self._conn.recv()
                with self._lock:
                    fut = self._pending.pop(rid)
                fut.set_result(rc)
        except (EOFError, OSError):
            with self._lock:
                pending, self._pending = list(self._pending.values()), {}
            for fut in pending:
                fut.set_exception(RuntimeError("the warm start server exited before the run ended "
                                               f"(exit {self._proc.exitcode})"))

    def close(self) -> None:
        if self._proc is None:
            return
        with self._lock:
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()

    def __enter__(self) -> WarmStarter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
