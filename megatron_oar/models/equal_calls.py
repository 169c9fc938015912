"""When the data-parallel ranks must make equally many model calls in a pass, and how many.

Two things pair collectives across DP ranks inside a model call:

* **Expert parallelism across DP ranks.** Every MoE layer's token dispatcher (all-to-all or
  all-gather) and an expert-tensor-parallel expert's all-reduce are collectives over the
  expert tensor-and-model-parallel group (ETP x EP), in the forward and in the backward. In
  megatron-core's layout (``parallel_state.initialize_model_parallel``, order ``tp-cp-ep-dp-pp``)
  the dense ranks of a pipeline stage are ``tp + TP * (cp + CP * dp)`` and the expert ranks
  ``etp + ETP * (ep + EP * edp)`` over the same ranks; an ETP x EP group lies inside one
  TP x CP group (ranks that hold one data-parallel shard's batch) when ``ETP * EP`` divides
  ``TP * CP`` (e.g. EP2 inside TP2 with ETP1), and otherwise spans DP ranks, which hold
  different batches (EP2 at TP1 over DP2; the shipped Qwen3-MoE examples, EP8 x TP4 on 8 GPUs).
  :func:`expert_groups_span_dp` reads it from the process groups themselves.
* **FP8 in a grad-enabled pass.** Transformer Engine's delayed scaling all-reduces amax over
  TP x DP at each FP8 autocast exit of a grad-enabled forward and in its backward (the update;
  OAR-G under ``attribution.allow_fp8``). Forward-only passes run with autograd off, where TE
  reduces nothing.

In either case a rank that runs fewer micro-batches than another would pair those collectives
with the wrong call, or wait forever. ``models.forward.run_schedule`` then makes every DP rank
run :func:`agreed_count` (the most any rank runs) calls, the short ranks running filler calls
whose outputs are discarded and whose loss is 0; passes that run several schedules (OAR-P's
length buckets) agree on the number of schedules the same way (verl's ``same_micro_num_in_dp``
rule, applied to every Megatron pass).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def expert_groups_span_dp() -> bool:
    """Whether this rank's expert tensor-and-model-parallel group (the MoE dispatcher's and the
    experts' collectives) holds ranks of other data-parallel shards: ranks outside this rank's
    tensor-and-context-parallel group (which all hold this shard's batch). False without
    expert parallelism or before megatron's groups exist."""
    if not ps.model_parallel_is_initialized():
        return False
    if ps.get_expert_tensor_and_model_parallel_world_size() <= 1:
        return False
    experts = dist.get_process_group_ranks(ps.get_expert_tensor_and_model_parallel_group())
    same_batch = dist.get_process_group_ranks(ps.get_tensor_and_context_parallel_group())
    return not set(experts) <= set(same_batch)


def equal_calls(config, forward_only: bool) -> bool:
    """Whether the DP ranks must make equally many model calls in a pass of a model with
    ``config`` (a megatron ``TransformerConfig``): expert groups spanning DP ranks (every pass),
    or FP8 autocast in a pass with a backward (``forward_only=False``; any recipe: only
    ``delayed`` reduces amax over DP, but one all-reduce of a count per pass is cheaper than
    reasoning about each recipe). The same answer on every rank of a DP group."""
    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() <= 1:
        return False
    return expert_groups_span_dp() or (bool(getattr(config, "fp8", None)) and not forward_only)


def agreed_count(n: int) -> int:
    """The most of ``n`` over the data-parallel group (collective over it; on the current CUDA
    device where there is one, as NCCL needs)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return int(t)
