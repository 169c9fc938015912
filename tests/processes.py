"""The live processes of this machine, from ``/proc`` (Linux): the suite's checks that nothing a
test started is left behind (conftest's end-of-run check, the fault tests' runs)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# how long a helper may take to end after what it serves has ended (the verifier pool's workers
# look for their parent once a second)
GRACE_S = 10.0


def _stat(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (state, ppid, pgrp, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running, and not a zombie (dead, not yet reaped)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _cmdline(pid: int | str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ(pid: int | str) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def live(select: Callable[[str, list[str]], bool]) -> dict[int, str]:
    """Live processes for which ``select(pid, stat fields)`` holds: pid -> command line."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and select(pid, stat):
            out[int(pid)] = _cmdline(pid)
    return out


def children(parent: int) -> dict[int, str]:
    """Live child processes of ``parent``."""
    return live(lambda pid, stat: int(stat[1]) == parent)


def carrying(key: str, value: str) -> dict[int, str]:
    """Live processes whose environment holds ``key=value`` (a run's id: everything the run started
    inherits it, wherever it was re-parented)."""
    entry = f"{key}={value}".encode()
    return live(lambda pid, stat: entry in _environ(pid).split(b"\0"))


def wait_gone(find: Callable[[], dict[int, str]], grace_s: float = GRACE_S) -> dict[int, str]:
    """``find()`` once it is empty, or what it still finds after ``grace_s`` seconds."""
    deadline = time.monotonic() + grace_s
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
