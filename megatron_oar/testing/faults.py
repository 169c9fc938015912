"""Fault injection for the fault-tolerance tests: real faults at named points of a real run.

``OAR_FAULTS`` (environment; unset in normal runs, where :func:`inject` costs one dict lookup)
holds comma-separated faults ``ACTION@POINT[:key=value...]``::

    OAR_FAULTS="kill@update:step=3:rank=1"            SIGKILL rank 1 inside step 3's update
    OAR_FAULTS="hang@generate:step=2:rank=1"          sleep forever inside step 2's generation
    OAR_FAULTS="freeze@rollout.generate:step=2"       SIGSTOP this process (threads included: a
                                                      lost host, as the others see it)
    OAR_FAULTS="kill@checkpoint.shards:step=4"        die between the weight and optimizer shards
    OAR_FAULTS="enospc@checkpoint.shards:step=4"      raise OSError(ENOSPC) there
    OAR_FAULTS="error@sync.bucket:step=2:rank=0"      raise RuntimeError inside the weight sync
    OAR_FAULTS="term-launcher@update:step=3:rank=0"   SIGTERM to the parent (torchrun) process
    OAR_FAULTS="stall@generate:step=3:seconds=8"      a phase that takes 8 s longer (a long one)
    OAR_FAULTS="stall-until-signal@generate:step=3"   a phase that lasts until the rank gets a
                                                      stop signal (SIGTERM/SIGUSR1; at most
                                                      ``seconds``): a signal during that phase

Points are the trainer's phases (``training/phases.py``: ``generate``, ``update``, ...) and
finer ones inside them (``checkpoint.shards``, ``sync.bucket``), and ``rollout.generate`` on a
rollout rank of the separate placement (``step``: its n-th generation request, from 1). ``step`` is the step being
computed, numbered as the logs and checkpoints number it (the first step is 1; the evaluation
before it is step 0). Filters: ``step``, ``rank`` (global), ``attempt`` (torchrun's
``TORCHELASTIC_RESTART_COUNT``; default 0, so a restarted group runs clean); ``seconds`` is the
stall's length (default 10; for ``stall-until-signal`` the longest wait). A fault fires at most once per process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import socket
import time
from dataclasses import dataclass, field

ENV = "OAR_FAULTS"
ACTIONS = ("kill", "hang", "freeze", "enospc", "error", "term-launcher", "stall", "stall-until-signal")
FILTERS = ("step", "rank", "attempt")


@dataclass
class Fault:
    action: str
    point: str
    when: dict[str, int] = field(default_factory=dict)  # FILTERS
    seconds: int = 10  # a stall's length
    fired: bool = False

    def matches(self, point: str, step: int | None) -> bool:
        if self.fired or point != self.point:
            return False
        # global: torchrun's rank also where the separate placement made RANK the role's
        now = {"step": step, "rank": _env_int("OAR_GLOBAL_RANK", _env_int("RANK", 0)),
               "attempt": _env_int("TORCHELASTIC_RESTART_COUNT", 0)}
        wanted = {"attempt": 0, **self.when}
        return all(now[k] == v for k, v in wanted.items())


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def parse(text: str) -> list[Fault]:
    """``OAR_FAULTS`` -> faults; a malformed entry raises ``ValueError`` naming it."""
    faults = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, *filters = item.split(":")
        action, _, point = head.partition("@")
        if action not in ACTIONS or not point:
            raise ValueError(f"{ENV}: {item!r}: expected ACTION@POINT[:key=value...] with ACTION "
                             f"one of {', '.join(ACTIONS)}")
        when, seconds = {}, 10
        for f in filters:
            key, _, value = f.partition("=")
            if key not in (*FILTERS, "seconds") or not value.lstrip("-").isdigit():
                raise ValueError(f"{ENV}: {item!r}: filter {f!r} is not step=N, rank=N, attempt=N "
                                 "or seconds=N")
            if key == "seconds":
                seconds = int(value)
            else:
                when[key] = int(value)
        faults.append(Fault(action, point, when, seconds))
    return faults


_FAULTS: list[Fault] | None = None


def _faults() -> list[Fault]:
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = parse(os.environ.get(ENV, ""))
    return _FAULTS


def reset() -> None:
    """Forgets the parsed ``OAR_FAULTS`` (tests that change it within one process)."""
    global _FAULTS
    _FAULTS = None


def inject(point: str, *, step: int | None = None) -> None:
    """Carries out the fault registered for ``point`` at ``step`` on this rank, if any."""
    for fault in _faults():
        if fault.matches(point, step):
            fault.fired = True
            _fire(fault, step)


def _fire(fault: Fault, step: int | None) -> None:
    where = f"{fault.point} (step {step}, rank {_env_int('OAR_GLOBAL_RANK', _env_int('RANK', 0))})"
    if fault.action == "stall-until-signal":
        with _stop_signal_wakeup() as wait:  # armed before the line a test may answer
            print(f"[{ENV}] injecting {fault.action} at {where}", flush=True)
            wait(fault.seconds)
        return
    print(f"[{ENV}] injecting {fault.action} at {where}", flush=True)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "hang":
        while True:
            time.sleep(3600)
    elif fault.action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"<{ENV} at {where}>")
    elif fault.action == "error":
        raise RuntimeError(f"{ENV}: injected error at {where}")
    elif fault.action == "term-launcher":
        os.kill(os.getppid(), signal.SIGTERM)
    elif fault.action == "stall":
        time.sleep(fault.seconds)


@contextlib.contextmanager
def _stop_signal_wakeup():
    """Yields ``wait(seconds)``, which returns once this process has received a stop signal
    (``STOP_SIGNALS``, while a Python handler such as the trainer's is installed: its handler
    runs as usual) since the block was entered, or after ``seconds``. Uses Python's signal
    wake-up fd, so it must run on the main thread; the previous fd is put back."""
    from megatron_oar.runtime.stop_signals import STOP_SIGNALS

    r, w = socket.socketpair()
    r.setblocking(False)
    w.setblocking(False)
    previous = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)

    def wait(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([r], [], [], left)[0] and set(r.recv(64)) & set(STOP_SIGNALS):
                return

    try:
        yield wait
    finally:
        signal.set_wakeup_fd(previous)
        r.close()
        w.close()
