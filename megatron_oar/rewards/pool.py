"""A process pool for answer verification with a hard per-answer time limit.

Each worker is a separate process (``forkserver`` by default, ``spawn`` also works) with its own
pipe. The caller hands out one task per idle worker and waits on the pipes; a worker that has not
answered ``timeout_s`` after it got its task is killed (SIGKILL) and replaced, and its task is
reported as ``timeout``. A worker that dies (segfault, out of memory) is replaced the same way
and its task is reported as ``error``. Nothing a task does can hang the caller; ``map(tasks,
budget_s)`` can also bound a whole call.

Workers ignore SIGINT (the pool shuts them down) and never see SIGTERM / SIGUSR1 (torchrun
sends those to the rank's whole process group: ``runtime/stop_signals.py``), can be given an address-space limit
(``memory_limit_mb``), and exit by themselves when their parent process goes away.
``close()`` (or leaving the ``with`` block) stops every worker and reaps it.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import wait

from megatron_oar.rewards.extract import AnswerParseError
from megatron_oar.runtime.stop_signals import helpers_shielded

log = logging.getLogger(__name__)

STATUSES = ("ok", "no_answer", "parse_error", "timeout", "error")


@dataclass(frozen=True)
class VerifyResult:
    """One task's outcome: ``status`` is ``ok``, ``parse_error``, ``timeout`` or ``error``."""

    status: str
    correct: bool = False
    detail: str = ""


def load_verifier(spec: str, options: dict | None = None):
    """Returns the verify function named by ``spec``.

    ``"math_verify"`` is :func:`megatron_oar.rewards.verify.math_verify_equal` with ``options``
    as keyword arguments; ``"package.module:function"`` imports a function
    ``fn(pred: str, gold: str) -> bool`` (it may raise ``AnswerParseError``).
    """
    if spec == "math_verify":
        from megatron_oar.rewards.verify import math_verify_equal
        return partial(math_verify_equal, **(options or {}))
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"rewards.verifier must be 'math_verify' or 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"rewards.verifier {spec!r}: {module} has no function {name!r}")
    return fn


def _exit_with_parent(parent_pid: int) -> None:
    """Daemon thread: ends the worker when the process that started it is gone."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _worker_main(conn, spec: str, options: dict, memory_limit_mb: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    if memory_limit_mb:
        import resource
        limit = int(memory_limit_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        fn = load_verifier(spec, options)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        key, pred, gold = msg
        try:
            result = ("ok", bool(fn(pred, gold)), "")
        except AnswerParseError as e:
            result = ("parse_error", False, str(e)[:300])
        except MemoryError:
            result = ("error", False, "MemoryError (rewards.worker_memory_mb)")
        except BaseException as e:  # noqa: BLE001 - untrusted input may raise anything
            result = ("error", False, f"{type(e).__name__}: {str(e)[:300]}")
        try:
            conn.send((key, *result))
        except (EOFError, OSError):
            return


class _Worker:
    def __init__(self, ctx, spec: str, options: dict, memory_limit_mb: int | None):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, options, memory_limit_mb),
                                daemon=True, name="oar-verifier")
        with helpers_shielded():  # torchrun's SIGTERM/SIGUSR1 reach the whole process group
            self.proc.start()
        child.close()
        self.ready = False
        self.task = None  # (key, deadline) while busy

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()


class VerifierPool:
    """``num_workers`` verifier processes; ``map`` checks (pred, gold) pairs under ``timeout_s`` each.

    Use as a context manager or call ``close()``. ``restarts`` counts workers killed and replaced.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, *, verifier: str = "math_verify",
                 verifier_options: dict | None = None, start_method: str = "forkserver",
                 memory_limit_mb: int | None = 4096, startup_timeout_s: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"rewards.num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"rewards.timeout_s must be > 0, got {timeout_s}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"rewards.start_method must be 'forkserver' or 'spawn', got {start_method!r}"
                             " (fork is unsafe in a process that holds threads or CUDA)")
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.restarts = 0
        self._args = (verifier, dict(verifier_options or {}), memory_limit_mb)
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            preload = ["megatron_oar.rewards.pool"]
            if verifier == "math_verify":
                preload.append("megatron_oar.rewards.verify")
            self._ctx.set_forkserver_preload(preload)
        self._workers: list[_Worker] = []
        self._closed = False
        try:
            self._workers = [self._spawn() for _ in range(num_workers)]
            self._wait_ready(self._workers)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- lifecycle

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, *self._args)

    def _wait_ready(self, workers: list[_Worker]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = [w for w in workers if not w.ready]
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"verifier workers did not start within {self.startup_timeout_s:.0f} s "
                                   "(rewards.startup_timeout_s)")
            for conn in wait([w.conn for w in pending], timeout=left):
                w = next(w for w in pending if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    w.proc.join(1.0)
                    msg = ("fatal", (f"worker exited with code {w.proc.exitcode} during start-up "
                                     "(a script that starts the pool needs an `if __name__ == "
                                     "'__main__':` guard, as with any forkserver/spawn process)"))
                if msg[0] == "fatal":
                    raise RuntimeError(f"verifier worker failed to start (rewards.verifier="
                                       f"{self._args[0]!r}): {msg[1]}")
                w.ready = True
                pending.remove(w)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.restarts += 1
        fresh = self._spawn()
        self._workers[self._workers.index(w)] = fresh
        self._wait_ready([fresh])

    def close(self) -> None:
        """Stops all workers: asks them to exit, kills any that do not within 2 s, reaps them."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for w in self._workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            w.kill()
        self._workers = []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (tests use them to check that kills happen)."""
        return [w.proc.pid for w in self._workers]

    # ---------------------------------------------------------------- work

    def map(self, tasks: list[tuple[str, str]], budget_s: float | None = None) -> list[VerifyResult]:
        """Verifies each ``(pred, gold)`` pair; returns one ``VerifyResult`` per task, in order.

        ``budget_s`` bounds the whole call: once it is spent, running tasks are killed and tasks
        not yet started are reported as ``timeout`` without running.
        """
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        try:
            return self._map(tasks, budget_s)
        except BaseException:
            self.close()  # a half-done map leaves busy workers: do not reuse them
            raise

    def _map(self, tasks: list[tuple[str, str]], budget_s: float | None) -> list[VerifyResult]:
        results: list[VerifyResult | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        end = time.monotonic() + budget_s if budget_s is not None else float("inf")
        while queue or any(w.task for w in self._workers):
            now = time.monotonic()
            if now >= end:
                while queue:
                    results[queue.popleft()] = VerifyResult(
                        "timeout", False, f"not started: batch budget of {budget_s:g} s spent")
            for w in self._workers:
                if w.task is None and queue:
                    key = queue.popleft()
                    pred, gold = tasks[key]
                    try:
                        w.conn.send((key, pred, gold))
                    except (OSError, ValueError):  # died while idle: replace, retry the task
                        queue.appendleft(key)
                        self._replace(w)
                        continue
                    w.task = (key, min(now + self.timeout_s, end))
            busy = [w for w in self._workers if w.task]
            if not busy:
                continue
            left = max(0.0, min(w.task[1] for w in busy) - time.monotonic())
            ready = wait([w.conn for w in busy], timeout=left)
            for w in busy:
                key, deadline = w.task
                if w.conn in ready:
                    try:
                        got = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(1.0)
                        results[key] = VerifyResult("error", False,
                                                    f"verifier worker died (exit code {w.proc.exitcode})")
                        w.task = None
                        self._replace(w)
                        continue
                    results[key] = VerifyResult(got[1], got[2], got[3])
                    w.task = None
                elif time.monotonic() >= deadline:
                    results[key] = VerifyResult("timeout", False,
                                                f"no answer within {self.timeout_s:g} s; worker killed"
                                                if deadline < end else
                                                f"batch budget of {budget_s:g} s spent; worker killed")
                    w.task = None
                    self._replace(w)
        return results  # type: ignore[return-value]
