"""The signals that ask a run to stop, and the helper processes that must not die of them.

Slurm, Kubernetes and torchrun ask a job to stop with SIGTERM, or SIGUSR1 ahead of Slurm's time
limit (``launch_scripts/env.sh``: ``PET_SIGNALS_TO_HANDLE``). torchrun forwards the signal to each
worker's whole process group (``os.killpg``), so every process a rank has started gets it too:
Python's multiprocessing resource tracker, the verifier pool's forkserver and workers,
megatron-core's checkpoint-writer Manager. They are started with the default disposition and
died of it while the rank was finishing its step and saving ("resource_tracker: process died
unexpectedly, relaunching. Some resources might leak" on every preemption; once, a rank ended
inside the preemption checkpoint and the others failed in its all_gather).

Helpers started inside :func:`helpers_shielded` begin life with these signals blocked (a blocked
mask survives fork and exec, and Python does not reset it): the rank alone decides when to stop,
and the helpers end with it (closed pipes, ``PR_SET_PDEATHSIG``, the pool's own shutdown).
A signal that reaches the rank while it starts one stays pending for that moment, and is then
handled as usual.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def helpers_shielded() -> Iterator[None]:
    """Processes started in the block (by this thread) ignore :data:`STOP_SIGNALS` for good."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_resource_tracker_shielded() -> None:
    """Starts multiprocessing's resource tracker (one per process, started on first use by any
    library) now, shielded. Where something has started it already, nothing changes."""
    from multiprocessing import resource_tracker

    with helpers_shielded():
        resource_tracker.ensure_running()
