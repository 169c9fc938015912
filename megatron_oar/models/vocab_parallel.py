"""Softmax statistics on vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice ``[start, end)`` of the padded vocabulary
(``GPTModel`` with ``parallel_output=True``). The functions below return per-rank *local*
pieces (log-probs of the local slice) or full-vocabulary scalars (all-reduced), are
differentiable with the right gradients on every rank, and mask the padded rows
``>= vocab_size`` out of every normaliser (megatron's own vocab-parallel cross entropy does not).

Gradients across TP ranks: every rank evaluates the same scalar objective and back-propagates it
locally. A full-vocabulary result that is consumed *replicated* (a KL, an entropy, a target
log-prob) is reduced with megatron's ``reduce_from_tensor_model_parallel_region`` (identity
backward). The softmax normaliser is consumed by each rank's *own* slice, so its gradient must be
summed over the ranks: it is reduced with an all-reduce whose backward is an all-reduce too.

Compute is float32 by default; ``dtype=torch.float64`` is for small probe tensors, where the
cancellation in ``q - p`` (OAR-G's gradient) needs the extra precision.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

from megatron_oar.models.builder import mask_padded_vocab


def vocab_slice(local_size: int) -> tuple[int, int]:
    """``[start, end)`` of this TP rank's slice of the padded vocabulary."""
    rank = parallel_state.get_tensor_model_parallel_rank()
    return rank * local_size, (rank + 1) * local_size


def masked_logits(logits: torch.Tensor, vocab_size: int, dtype=torch.float32) -> torch.Tensor:
    """Local logits in ``dtype`` with the padded vocabulary rows at -inf."""
    return mask_padded_vocab(logits.to(dtype), vocab_size, vocab_slice(logits.shape[-1])[0])


def _tp_max(x: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return x


class _SumForSlices(torch.autograd.Function):
    """All-reduce (sum) over TP whose backward also sums: for values each rank's slice uses."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_for_slices(x: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return x
    return _SumForSlices.apply(x, parallel_state.get_tensor_model_parallel_group())


def log_softmax(logits: torch.Tensor, vocab_size: int, dtype=torch.float32) -> torch.Tensor:
    """Local slice of ``log_softmax`` over the true vocabulary; padded rows are -inf."""
    x = masked_logits(logits, vocab_size, dtype)
    peak = _tp_max(x.detach().amax(dim=-1, keepdim=True))  # a constant shift: no gradient needed
    shifted = x - peak
    total = _sum_for_slices(shifted.exp().sum(dim=-1, keepdim=True))
    return shifted - total.log()


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                    dtype=torch.float32) -> torch.Tensor:
    """``log p(target)`` per position (``logits [..., V/TP]``, ``targets [...]``), all-reduced."""
    logp = log_softmax(logits, vocab_size, dtype)
    start, end = vocab_slice(logits.shape[-1])
    local = (targets >= start) & (targets < end)
    index = (targets - start).clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    picked = logp.gather(-1, index).squeeze(-1)
    return reduce_from_tensor_model_parallel_region(torch.where(local, picked, torch.zeros_like(picked)))


def entropy(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token entropy ``-sum p log p`` over the true vocabulary (Eq. 5), all-reduced."""
    logp = log_softmax(logits, vocab_size)
    padded = torch.isinf(logp)
    safe = logp.masked_fill(padded, 0.0)  # 0 * -inf would poison the backward with NaN
    plogp = (safe.exp() * safe).masked_fill(padded, 0.0)
    return -reduce_from_tensor_model_parallel_region(plogp.sum(dim=-1))


def kl_divergence(teacher_logp: torch.Tensor, student_logp: torch.Tensor) -> torch.Tensor:
    """``KL(P || Q)`` from local log-prob slices of P (teacher) and Q (student), all-reduced."""
    if teacher_logp.shape != student_logp.shape:
        raise ValueError(f"teacher log-probs {tuple(teacher_logp.shape)} and student log-probs "
                         f"{tuple(student_logp.shape)} differ: both must be this rank's padded vocab slice")
    p = teacher_logp.exp()
    absent = p == 0  # padded rows (and underflow): they contribute 0, never NaN
    diff = teacher_logp.masked_fill(absent, 0.0) - student_logp.masked_fill(absent, 0.0)
    return reduce_from_tensor_model_parallel_region((p * diff).sum(dim=-1))


@torch.no_grad()
def top_k(logits: torch.Tensor, vocab_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, token ids)`` of the ``k`` largest logits over the whole true vocabulary,
    ``[..., k]`` each, from local vocab-parallel slices: each TP rank's top ``k`` are gathered
    (``k`` per rank, never the full vocabulary) and reduced again."""
    local = masked_logits(logits, vocab_size)
    values, ids = local.topk(k, dim=-1)
    ids = ids + vocab_slice(logits.shape[-1])[0]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        all_values = [torch.empty_like(values) for _ in range(tp)]
        all_ids = [torch.empty_like(ids) for _ in range(tp)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_ids, ids.contiguous(), group=group)
        values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)
        order = values.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        values, ids = values.gather(-1, order), ids.gather(-1, order)
    return values, ids
