"""Python logging for the entry points (``oar train``, ``oar eval``, ``oar analyze oracle``).

    setup_logging(rank)                   # before the config is read: INFO on rank 0
    setup_logging(rank, cfg.log.level)    # once it is: "info" or "debug"

Rank 0 logs at INFO (DEBUG with ``log.level=debug``), the other ranks at WARNING. vLLM logs every
weight reload and prefix-cache reset at INFO, which would interleave with the progress lines, so
it stays at WARNING unless ``log.level=debug``; a ``VLLM_LOGGING_LEVEL`` set in the environment
wins (vLLM reads it when it is imported, in this process and in its engine processes).
"""

from __future__ import annotations

import logging
import os

LEVELS = ("info", "debug")
QUIET_LIBRARIES = ("vllm",)


def setup_logging(rank: int = 0, level: str = "info") -> None:
    if level not in LEVELS:
        raise ValueError(f"log.level must be one of {', '.join(LEVELS)}, got {level!r}")
    debug = level == "debug"
    ours = (logging.DEBUG if debug else logging.INFO) if rank == 0 else logging.WARNING
    logging.basicConfig(level=ours, format=f"[rank{rank}] %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger().setLevel(ours)
    library = "DEBUG" if debug else "WARNING"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", library)
    for name in QUIET_LIBRARIES:  # already imported: set the level on its logger too
        logging.getLogger(name).setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
