"""Did the weight sync work? vLLM's logprobs of the sampled tokens against Megatron's forward.

:func:`token_logprobs` runs megatron's own schedule (forward only) and computes
``log p(x_{t+1} | x_{<=t})`` vocab-parallel (``models.vocab_parallel``: padded vocabulary rows
masked, full-vocabulary logits never gathered).
:func:`logprob_agreement` compares these with the logprobs vLLM reported for a
:class:`~megatron_oar.rollout.batch.RolloutBatch`, spreading the sequences over the training
data-parallel ranks, and returns the mean and max absolute difference over all response tokens.
:func:`check_policy_agreement` is the trainer's per-step guard on the same quantity, from the
log-probs the step computes anyway; it and a failed sync raise :class:`WeightSyncError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_oar.models import vocab_parallel as vp
from megatron_oar.models.equal_calls import equal_calls
from megatron_oar.models.forward import forward_map
from megatron_oar.models.parallel import unwrap
from megatron_oar.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class LogprobAgreement:
    """|Megatron logprob - vLLM logprob| over every response token of a batch."""

    mean_abs_diff: float
    max_abs_diff: float
    num_tokens: int

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        return {f"{prefix}logprob_diff_mean": self.mean_abs_diff,
                f"{prefix}logprob_diff_max": self.max_abs_diff,
                f"{prefix}logprob_check_tokens": float(self.num_tokens)}


def _stats_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def token_logprobs(model, tokens: torch.Tensor, vocab_size: int,
                   micro_batch_size: int | None = None) -> torch.Tensor | None:
    """``[B, S-1]`` log-probabilities of ``tokens[:, 1:]`` under ``model`` (temperature 1, true
    vocabulary) through megatron's schedule; on the last pipeline stage, ``None`` elsewhere.
    ``tokens`` must be identical on every rank of the model-parallel group."""
    return forward_map(model, tokens,
                       lambda out, batch: vp.target_logprobs(out[:, :-1], batch[:, 1:], vocab_size),
                       micro_batch_size)


def logprob_agreement(model, batch: RolloutBatch, vocab_size: int, *,
                      micro_batch_size: int = 1, pad_id: int = 0) -> LogprobAgreement:
    """Collective over the world: compares ``batch``'s vLLM logprobs with Megatron's.

    ``batch`` must be the same on every rank (e.g. :func:`~megatron_oar.rollout.engine.gather_rollouts`
    of each rollout group's output). Training DP rank ``d`` checks sequences ``d, d+DP, ...``.
    The comparison is meaningful for ``logprobs_mode='raw_logprobs'`` (temperature-1
    log-softmax, which Megatron computes here) or for processed logprobs sampled at
    temperature 1 with top-p 1 and no top-k; anything else raises ``ValueError``.
    """
    from megatron.core import parallel_state as ps

    if batch.logprobs_mode != "raw_logprobs" and not (
            batch.temperature == 1.0 and batch.top_p == 1.0 and batch.top_k in (0, -1)):
        raise ValueError(
            f"logprobs_mode={batch.logprobs_mode!r} with temperature={batch.temperature}, "
            f"top_p={batch.top_p}, top_k={batch.top_k}: vLLM's logprobs are of the processed "
            "distribution, not Megatron's temperature-1 softmax; use logprobs_mode='raw_logprobs' "
            "or sample the check batch at temperature 1, top_p 1, top_k off")
    seqs, vllm_logprobs = batch.to_sequences(pad_id=pad_id)
    dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = list(range(d, seqs.size, dp))
    stats = torch.zeros(2, dtype=torch.float64, device=_stats_device())  # sum |diff|, count
    peak = torch.zeros(1, dtype=torch.float64, device=_stats_device())
    # a rank without rows whose model calls pair other DP ranks' (models.equal_calls) runs the
    # first row as a filler and counts nothing (the schedule adds filler calls to the others)
    filler = not rows and seqs.size > 0 and equal_calls(unwrap(model).config, forward_only=True)
    if rows or filler:
        run = rows or [0]
        pad_rows = (-len(run)) % micro_batch_size
        idx = torch.tensor(run + [run[-1]] * pad_rows)
        length = int(seqs.lengths[idx].max())
        tokens = seqs.tokens[idx, :length].to(_stats_device())
        ours = token_logprobs(model, tokens, vocab_size, micro_batch_size)
        # one rank per TP and CP group counts (the CP ranks of a DP rank score the same rows)
        contributes = (ours is not None and ps.get_tensor_model_parallel_rank() == 0 and not filler
                       and ps.get_context_parallel_rank() == 0)
        if contributes:
            n = len(rows)
            mask = seqs.response_mask()[idx[:n], 1:length].to(ours.device)
            theirs = vllm_logprobs[idx[:n], 1:length].to(ours.device)
            diff = (ours[:n].double() - theirs.double()).abs()[mask]
            if diff.numel():
                stats[0] += diff.sum()
                stats[1] += diff.numel()
                peak[0] = diff.max()
    dist.all_reduce(stats)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    count = int(stats[1].item())
    return LogprobAgreement(mean_abs_diff=float(stats[0] / max(count, 1)),
                            max_abs_diff=float(peak[0]), num_tokens=count)


class WeightSyncError(RuntimeError):
    """vLLM does not hold the policy being trained: a weight sync failed (raised on some rank,
    see :meth:`~megatron_oar.rollout.engine.RolloutEngine.sync_weights`) or its result disagrees
    with the policy (:func:`check_policy_agreement`). The run must stop: resume from the last
    checkpoint."""


def check_policy_agreement(rollout_logprobs: torch.Tensor, policy_logprobs: torch.Tensor,
                           mask: torch.Tensor, *, limit: float | None, step: int, group=None) -> float:
    """Collective over ``group`` (every rank of it, whatever ``limit``): the mean |vLLM - policy|
    log-prob per response token of the step, over the whole group; raises
    :class:`WeightSyncError` on every rank when it is above ``limit`` or not a number
    (``limit=None``: measure only).

    ``rollout_logprobs``, ``policy_logprobs`` and ``mask`` are ``[B, L]`` for this rank's rows.
    Masked-out positions count for nothing, even when they hold NaN or inf. Ranks that hold the
    same rows (the tensor- and pipeline-parallel ranks of one data-parallel shard: the trainer's
    old-logprob pass returns the log-probs on every stage) count them as often as every other
    shard is counted, ``tp * pp`` times, which leaves the mean unchanged. Every rank computes
    the same reduced numbers, so all raise or none does.
    """
    mask = mask.bool()
    diff = (rollout_logprobs.double() - policy_logprobs.double()).abs()
    diff = torch.where(mask, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))
    stats = torch.stack([diff.sum(), mask.sum().double()]).cpu()
    if group is not None:
        dist.all_reduce(stats, group=group)
    mean = float(stats[0]) / max(float(stats[1]), 1.0)
    if limit is not None and not mean <= limit:
        raise WeightSyncError(
            f"step {step}: vLLM's log-probs of the sampled tokens differ from the policy's by "
            f"{mean:.4g} nats per response token on average, above "
            f"rollout.max_logprob_mismatch={limit} (healthy runs: ~1e-2 in bf16, ~1e-7 in fp32): "
            "vLLM did not generate with the policy being trained (a failed or partial weight "
            "sync?). The run stops before updating on these rollouts (the policy's weights are "
            "those of the previous step); resume from the last checkpoint, or set "
            "rollout.max_logprob_mismatch=null to turn the check off")
    return mean
