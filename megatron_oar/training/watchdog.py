"""The hang watchdog: a phase that runs past ``train.phase_timeout_s`` ends the process.

A rank stuck in one phase (a collective whose peer died or wedged, a vLLM call that never
returns, a reward batch that never comes back) would otherwise hold its GPUs until the job's
time limit. Each rank arms a deadline when a phase starts (:meth:`PhaseWatchdog.phase`); when it
passes, the rank writes one line naming the phase, the step and the limit, then the stacks of
all its threads, to stderr and to ``{run_dir}/hangs/attempt<A>_rank<R>.txt``, and exits with
:data:`EXIT_HANG`. torchrun then stops the other ranks and, within ``launch.max_restarts``,
restarts the group, which resumes from the newest checkpoint. Every rank waiting in the same
phase passes the same deadline within moments, so each dumps its own stack.

The deadline is watched by a Python thread; as a backstop for a thread that holds the GIL
forever (a C call that never releases it), ``faulthandler`` dumps and exits on its own
``BACKSTOP_S`` later.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

EXIT_HANG = 124  # as timeout(1): the restart logic treats it as a failure of the attempt
BACKSTOP_S = 60.0


class PhaseWatchdog:
    """Per-rank deadline on the phase in progress; ``timeout_s`` 0 (or None) disables it."""

    def __init__(self, timeout_s: float | None, *, rank: int, dump_dir: str | Path,
                 attempt: int = 0, setting: str = "train.phase_timeout_s"):
        self.timeout_s = float(timeout_s or 0)
        self.rank, self.attempt, self.setting = rank, attempt, setting
        self.dump_path = Path(dump_dir) / f"attempt{attempt}_rank{rank:05d}.txt"
        self._lock = threading.Lock()
        self._armed: tuple[str, int | None, float, str] | None = None  # phase, step, deadline, limit
        self._depth = 0
        self._wake = threading.Event()
        self._closed = False
        self._thread = None
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="oar-phase-watchdog", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None, *, limit: tuple[float, str] | None = None):
        """Arms the deadline for the block (nested blocks keep the outer one). When it ends, the
        time until the next phase starts has its own deadline (named after the phase before), so
        no code between phases (a collective, say) runs unwatched; :meth:`close` ends it.
        ``limit``: this block's own ``(seconds, the setting it comes from)`` instead of
        ``timeout_s`` (the HF export at the end: ``checkpoint.convert_timeout_minutes``)."""
        if self._thread is None or self._depth:  # off, or nested: the outer deadline holds
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        self._arm(name, step, limit)
        try:
            yield
        finally:
            self._depth = 0
            if not self._closed:
                self._arm(f"after {name}", step)

    def _arm(self, name: str, step: int | None, limit: tuple[float, str] | None = None) -> None:
        seconds, setting = limit or (self.timeout_s, f"{self.setting}={self.timeout_s:g} s")
        with self._lock:
            self._armed = (name, step, time.monotonic() + seconds, setting)
        faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)
        self._wake.set()

    def close(self) -> None:
        """Stops watching (the run is over)."""
        self._closed = True
        with self._lock:
            self._armed = None
        self._wake.set()
        if self._thread is not None:
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        while not self._closed:
            with self._lock:
                armed = self._armed
            if armed is None:
                self._wake.wait()
                self._wake.clear()
                continue
            name, step, deadline, limit = armed
            left = deadline - time.monotonic()
            if left > 0:
                self._wake.wait(min(left, 1.0))
                self._wake.clear()
                continue
            with self._lock:
                if self._armed is armed:  # still the same phase: it hung
                    self._expire(name, step, limit)

    def _expire(self, name: str, step: int | None, limit: str) -> None:
        where = f"phase '{name}'" + (f" of step {step}" if step is not None else "")
        header = (f"rank {self.rank}: {where} ran past {limit} (attempt {self.attempt}); the "
                  f"stacks of its threads follow (also in {self.dump_path}); exiting with {EXIT_HANG} so torchrun "
                  "restarts the group from the newest checkpoint (launch.max_restarts)")
        print(header, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            self.dump_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.dump_path, "w") as f:
                f.write(header + "\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:  # the dump on stderr is what matters
            print(f"rank {self.rank}: could not write {self.dump_path}: {e}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(EXIT_HANG)
