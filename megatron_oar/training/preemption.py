"""Preemption: SIGTERM or SIGUSR1 makes every rank stop at the next phase boundary, checkpoint, and exit.

Slurm sends SIGUSR1 ahead of the time limit (``--signal=USR1@<grace>``, see
``launch_scripts/slurm.sbatch``) and SIGTERM when it preempts or cancels a job; Kubernetes sends
SIGTERM. torchrun forwards the signals it handles to the workers (``PET_SIGNALS_TO_HANDLE`` in
``env.sh`` adds SIGUSR1) and waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds for them before
SIGKILL.

The handler only records the signal. The ranks agree (:meth:`Preemption.requested`, a max over a
gloo group) at the entry of every phase of a step up to its update, and at the end of the step,
so they stop at the same point even when the signal reached some of them later. Signalled before
the update, the step is dropped (:class:`StepDropped`; the trainer rewinds the prompt sampler and
saves the RNG states the step began with, so the resumed run computes that step as if nothing
had happened); later, the step is finished. Either way the trainer saves a checkpoint and exits
with :data:`EXIT_PREEMPTED`, a failure status, so schedulers that retry failed jobs retry this
one and it resumes from that checkpoint. The worst case is one phase (the longest: generation
or the update) plus the save, instead of a whole step plus the save. A repeated signal is only
logged: torchrun and Slurm often deliver the same one twice.
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

from megatron_oar.runtime.stop_signals import STOP_SIGNALS

log = logging.getLogger(__name__)

SIGNALS = STOP_SIGNALS
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped early on request; run it again to continue


class StepDropped(Exception):
    """A stop signal came before the step's update: the step is dropped, not finished."""

    def __init__(self, phase: str):
        super().__init__(f"stop signal before phase {phase!r}")
        self.phase = phase


class Preemption:
    """Records SIGTERM/SIGUSR1 from :meth:`install` until :meth:`uninstall`."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> Preemption:
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a trainer inside a test thread)
                log.warning("preemption signals not handled: the trainer is not on the main thread")
                break
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
            log.warning("received %s: stopping at the next phase boundary, then checkpointing and exiting",
                        signal.Signals(signum).name)
        else:
            log.info("received %s again; already stopping after this step", signal.Signals(signum).name)

    def requested(self, group=None) -> bool:
        """Collective over ``group`` (the world if None): did any rank receive a signal?"""
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
