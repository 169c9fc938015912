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
