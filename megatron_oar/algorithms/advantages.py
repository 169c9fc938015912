"""Group-relative sequence advantages (GRPO, paper Eq. 2).

For the G completions of one prompt with rewards ``r_1..r_G``::

    A_i = (r_i - mean(r)) / (std(r) + eps)        std with 1/G (Eq. 2), eps for all-equal groups
    A_i =  r_i - mean(r)                           std_normalize=False (Dr.GRPO)

Groups are given either as a fixed ``group_size`` over contiguous rows (the rollout order) or
as ``group_ids`` (any order, any sizes: what remains after dynamic sampling or filtering).
"""

from __future__ import annotations

import torch


def _group_index(rewards: torch.Tensor, group_ids: torch.Tensor | None,
                 group_size: int | None) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_completions], got shape {tuple(rewards.shape)}")
    n = rewards.numel()
    if (group_ids is None) == (group_size is None):
        raise ValueError("give exactly one of group_ids or group_size")
    if group_ids is not None:
        if group_ids.shape != rewards.shape:
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, rewards {tuple(rewards.shape)}")
        return torch.unique(group_ids, return_inverse=True)[1]
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {n} rewards")
    return torch.arange(n, device=rewards.device) // group_size


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor | None = None,
                group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: its group's mean, population std, and whether all rewards in it are equal."""
    index = _group_index(rewards, group_ids, group_size)
    r = rewards.double()
    groups = int(index.max()) + 1 if index.numel() else 0
    zeros = torch.zeros(groups, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, index, torch.ones_like(r))
    mean = zeros.index_add(0, index, r) / count
    var = zeros.index_add(0, index, (r - mean[index]) ** 2) / count
    hi = zeros.scatter_reduce(0, index, r, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, index, r, "amin", include_self=False)
    return mean[index], var.sqrt()[index], (hi == lo)[index]


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | None = None,
                     group_size: int | None = None, *, std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Sequence advantages ``A_i`` of Eq. 2, one per completion, in ``rewards``' dtype.

    A group whose rewards are all equal gets ``A_i = 0`` (it carries no learning signal); a
    group of one completion likewise. ``std_normalize=False`` gives Dr.GRPO's unscaled
    advantages.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")
    mean, std, constant = group_stats(rewards, group_ids, group_size)
    adv = rewards.double() - mean
    if std_normalize:
        adv = adv / (std + eps)
    adv = adv.masked_fill(constant, 0.0)  # exactly 0, so zero-advantage rows are skipped downstream
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def constant_groups(rewards: torch.Tensor, group_ids: torch.Tensor | None = None,
                    group_size: int | None = None) -> torch.Tensor:
    """Bool per row: its group's rewards are all equal (dynamic sampling drops these groups)."""
    return group_stats(rewards, group_ids, group_size)[2]
