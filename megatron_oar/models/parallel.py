"""Small helpers over torch.distributed and megatron's model-parallel layout, shared by the
model, checkpoint, training and attribution code.

* :func:`rank`, :func:`barrier`: also outside a process group (one process: rank 0, no wait).
* :func:`unwrap`: the ``GPTModel`` inside megatron's DDP / Float16Module wrappers.
* :func:`broadcast_from_stage`: a tensor from the first or last pipeline stage to every stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def unwrap(model):
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def broadcast_from_stage(tensor: torch.Tensor, first: bool) -> torch.Tensor:
    """Send ``tensor`` from the first (or last) pipeline stage to every stage (in place)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    src = (parallel_state.get_pipeline_model_parallel_first_rank() if first
           else parallel_state.get_pipeline_model_parallel_last_rank())
    dist.broadcast(tensor, src=src, group=parallel_state.get_pipeline_model_parallel_group())
    return tensor
