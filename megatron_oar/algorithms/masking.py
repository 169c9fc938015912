"""Checks and reductions over ``[B, T]`` token tensors with a validity mask.

Every function in ``algorithms/`` takes a ``mask`` with 1 (or True) on the response tokens that
exist and 0 on padding. Padding may hold anything (even NaN): it is never read into a result.
"""

from __future__ import annotations

import torch


def as_bool_mask(mask: torch.Tensor, like: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """``mask`` as a bool tensor of ``like``'s shape; a clear error when the shapes differ."""
    if mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")
    return mask.bool() if mask.dtype != torch.bool else mask


def check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [batch, tokens], got shape {tuple(x.shape)}")


def sub_mask(mask: torch.Tensor, score_mask: torch.Tensor | None) -> torch.Tensor:
    """The scored tokens: ``score_mask`` restricted to ``mask`` (all of ``mask`` when None)."""
    if score_mask is None:
        return mask
    return as_bool_mask(score_mask, mask, "score_mask") & mask


def check_finite(x: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    """Raise naming the first offending rows when ``x`` is NaN or inf on a valid position."""
    bad = ~torch.isfinite(x) & mask
    if bad.any():
        rows = bad.any(dim=-1).nonzero().flatten().tolist()
        shown = ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")
        raise ValueError(f"{name} is NaN or inf on valid tokens of rows [{shown}] "
                         f"({int(bad.sum())} values); the attribution pass produced non-finite scores")


def float_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32 (bf16/fp16 scores are upcast before any arithmetic)."""
    return x if x.dtype == torch.float64 else x.float()


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    masked = torch.where(mask, x, zero)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over valid positions; 0 where there are none (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)
