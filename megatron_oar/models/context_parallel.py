"""Context parallelism (``parallel.cp``): a sequence split over the CP ranks, and gathered back.

Megatron-LM's layout (``get_batch_on_this_cp_rank``): a sequence padded to a multiple of
``2 x CP`` is cut into ``2 x CP`` equal chunks and CP rank ``r`` keeps chunks ``r`` and
``2 x CP - 1 - r``, so under causal attention every rank has the same amount of work (an early
chunk that attends to little paired with a late one that attends to much). megatron-core's
rotary embedding takes the same two chunks of the positions itself (``RotaryEmbedding.forward``:
``get_pos_emb_on_this_cp_rank``, with the rotary length ``s_local x CP``), so a rank runs the
model on its ``s / CP`` tokens and RoPE sees their global positions.

* :func:`split` / :func:`local_positions`: this rank's two chunks of a ``[.., s, ..]`` tensor,
  and their global positions. Packed (THD) sequences: :func:`thd_local_index`, the same two
  chunks of every packed row (Transformer Engine's THD layout; megatron's THD rotary embedding,
  ``_apply_rotary_pos_emb_thd``, takes each row's positions on this rank alike).
* :func:`gather`: the ranks' chunks back in sample order ``[.., s, ..]`` (an all-gather over the
  CP group), autograd-aware in one of two ways. ``replicated=True`` (the model's output, which
  every CP rank then processes identically into the same loss): the backward keeps this rank's
  part of the gradient, which is the whole of it for this rank's positions. ``replicated=False``
  (K/V inside attention, where each rank's queries read every rank's keys): the backward sums the
  ranks' gradients and keeps this rank's part (a reduce-scatter on NCCL; gloo, which has none, an
  all-reduce of which each rank keeps its part).

Everything here is a no-op at ``CP = 1``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


def cp_size() -> int:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1
    return ps.get_context_parallel_world_size()


def cp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank() if cp_size() > 1 else 0


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the ``2 x cp`` chunks CP rank ``rank`` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def _check_length(s: int, cp: int) -> None:
    if s % (2 * cp):
        raise ValueError(f"a sequence of {s} positions does not split into 2 x parallel.cp = {2 * cp} "
                         "equal chunks (pad it to a multiple first: models.padding)")


def split(t: torch.Tensor, dim: int = 1, cp: int | None = None, rank: int | None = None) -> torch.Tensor:
    """This CP rank's two chunks of ``t`` along ``dim`` (its local sequence, ``s / cp`` long)."""
    cp = cp_size() if cp is None else cp
    if cp == 1:
        return t
    rank = cp_rank() if rank is None else rank
    s = t.shape[dim]
    _check_length(s, cp)
    c = s // (2 * cp)
    first, second = chunk_ids(cp, rank)
    return torch.cat([t.narrow(dim, first * c, c), t.narrow(dim, second * c, c)], dim=dim)


def local_positions(s: int, cp: int | None = None, rank: int | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """``[s / cp]``: the global positions of this CP rank's tokens in a sequence of ``s``."""
    return split(torch.arange(s, device=device), 0, cp, rank)


def thd_local_index(cu_seqlens_padded, cp: int | None = None, rank: int | None = None,
                    device=None) -> torch.Tensor:
    """Packed (THD) sequences under CP, Transformer Engine's layout
    (``thd_get_partitioned_indices``): the positions in the packed sequence ``[T]`` (rows at the
    offsets ``cu_seqlens_padded``, each a multiple of ``2 x cp`` long) that CP rank ``rank``
    holds, in its local order: of every row in turn, its chunks ``rank`` and ``2 x cp - 1 -
    rank`` (each row split on its own, as :func:`split` splits one sequence)."""
    cp = cp_size() if cp is None else cp
    rank = cp_rank() if rank is None else rank
    cu = [int(x) for x in (cu_seqlens_padded.tolist() if torch.is_tensor(cu_seqlens_padded)
                           else cu_seqlens_padded)]
    parts = []
    for start, end in zip(cu, cu[1:]):
        _check_length(end - start, cp)
        c = (end - start) // (2 * cp)
        parts += [torch.arange(start + k * c, start + (k + 1) * c) for k in chunk_ids(cp, rank)]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)).to(device)


def thd_global_order(cu_seqlens_padded, cp: int, device=None) -> torch.Tensor:
    """Index into the rank-major concatenation of every rank's local packed sequence
    (:func:`thd_local_index`) that puts it in packed order. Cached per packed layout: a
    micro-batch's output gather (``models.forward.MicroInput``) and every attention layer's K/V
    gather (``models.sdpa_attention``) ask for the same one; callers must not modify it."""
    cu = cu_seqlens_padded.tolist() if torch.is_tensor(cu_seqlens_padded) else cu_seqlens_padded
    return _thd_global_order(tuple(int(x) for x in cu), cp, None if device is None else torch.device(device))


@functools.lru_cache(maxsize=8)
def _thd_global_order(cu: tuple[int, ...], cp: int, device: torch.device | None) -> torch.Tensor:
    held = torch.cat([thd_local_index(list(cu), cp, r) for r in range(cp)])
    return torch.argsort(held).to(device)


def global_order(cp: int, c: int, device=None) -> torch.Tensor:
    """Index into the rank-major concatenation of every rank's local sequence (chunks of ``c``)
    that puts it in sample order."""
    where = torch.empty(2 * cp, dtype=torch.long)
    for rank in range(cp):
        for half, chunk in enumerate(chunk_ids(cp, rank)):
            where[chunk] = 2 * rank + half
    return (where[:, None] * c + torch.arange(c)[None, :]).reshape(-1).to(device)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, replicated: bool, group, order) -> torch.Tensor:
        cp = dist.get_world_size(group)
        ctx.dim, ctx.replicated, ctx.group = dim, replicated, group
        ctx.local = x.shape[dim]
        moved = x.movedim(dim, 0).contiguous()
        parts = [torch.empty_like(moved) for _ in range(cp)]
        dist.all_gather(parts, moved, group=group)
        full = torch.cat(parts)  # rank-major
        order = global_order(cp, ctx.local // 2, full.device) if order is None else order.to(full.device)
        ctx.save_for_backward(order)
        return full.index_select(0, order).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        g = grad.movedim(ctx.dim, 0)
        rank_major = torch.empty_like(g)
        rank_major.index_copy_(0, order, g)  # back to rank-major (order is a permutation)
        rank_major = rank_major.contiguous()
        if not ctx.replicated and dist.get_backend(ctx.group) == "nccl":  # every rank's share, summed
            mine = rank_major.new_empty((ctx.local, *rank_major.shape[1:]))
            dist.reduce_scatter_tensor(mine, rank_major, group=ctx.group)
        else:
            if not ctx.replicated:  # gloo has no reduce-scatter: all-reduce, keep this rank's part
                dist.all_reduce(rank_major, group=ctx.group)
            mine = rank_major.narrow(0, dist.get_rank(ctx.group) * ctx.local, ctx.local)
        return mine.movedim(0, ctx.dim).contiguous(), None, None, None, None


def gather(x: torch.Tensor, dim: int = 1, *, replicated: bool, order: torch.Tensor | None = None) -> torch.Tensor:
    """Every CP rank's local sequence of ``x`` (along ``dim``) in sample order (module doc:
    ``replicated`` says what the backward does). ``x`` itself at ``CP = 1``. ``order``: the
    index that puts the rank-major concatenation in sample order, for packed sequences
    (:func:`thd_global_order`); default one sequence's (:func:`global_order`)."""
    if cp_size() == 1:
        return x
    from megatron.core import parallel_state as ps

    return _Gather.apply(x, dim, replicated, ps.get_context_parallel_group(), order)
