"""Atomic file writes: a reader (or a crash) never sees a half-written file.

The content goes to a temporary sibling, is flushed and fsynced, then renamed over ``path``;
on any error the temporary file is removed and ``path`` keeps its previous content.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: str | Path, write: Callable[[IO], object], mode: str = "w") -> Path:
    """Calls ``write(f)`` on a temporary file opened with ``mode`` (``"w"`` text as UTF-8, or
    ``"wb"``) and renames it to ``path``. The file gets the permissions ``open()`` would give."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what open() would have made
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text))
