"""Run a function in N CPU processes on gloo, the way torchrun would (env:// rendezvous)."""

from __future__ import annotations

import os
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from megatron_oar.runtime import destroy_runtime

    try:
        fn(*args)
    finally:
        destroy_runtime()


def launch(fn, world_size: int, *args) -> None:
    """Runs ``fn(*args)`` on ``world_size`` spawned ranks; raises if any rank fails."""
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                       join=True, start_method="spawn")
