"""Credit-concentration metrics (paper Appendix A.3) and fractions of reshaped tokens.

- ESS ratio (Eq. 27): ``(sum w)^2 / (T * sum w^2)`` in ``(0, 1]``; 1 is uniform credit.
- Top-10% advantage mass (Eq. 28): share of ``sum |A_t|`` carried by the ``K = max(1, floor(0.1 T))``
  tokens of largest ``|A_t|``.
- Fractions of valid tokens boosted (``w > 1``) and suppressed (``w < 1``) relative to GRPO.
- ``max_weight``: a row's largest weight, averaged over rows (1 for GRPO); with ``seq_adv``,
  ``max_weight_negative`` over the rows with ``A_i < 0`` only (0 when there are none): how much of
  a wrong rollout's blame its most-blamed token carries, in multiples of GRPO's.

Per-sequence values are averaged over the sequences where they are defined: a sequence needs
valid tokens, and for the mass metric a non-zero total advantage.
"""

from __future__ import annotations

import torch

from megatron_oar.algorithms.masking import as_bool_mask, check_2d, masked_mean, masked_sum

REL_TOL = 1e-6  # |w - 1| below this counts as unchanged


def ess_ratio(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 27 per row ``[B]``; NaN for rows without valid tokens or with all-zero weights."""
    check_2d(weights, "weights")
    mask = as_bool_mask(mask, weights)
    w = weights.double()
    total = masked_sum(w, mask, dim=-1)
    squares = masked_sum(w * w, mask, dim=-1)
    count = mask.sum(dim=-1).to(w.dtype)
    out = total ** 2 / (count * squares)
    return torch.where((count > 0) & (squares > 0), out, torch.full_like(out, float("nan"))).float()


def top_mass(token_adv: torch.Tensor, mask: torch.Tensor, frac: float = 0.1) -> torch.Tensor:
    """Eq. 28 per row ``[B]``; NaN for rows without valid tokens or with zero total |A|."""
    check_2d(token_adv, "token_adv")
    if not 0 < frac <= 1:
        raise ValueError(f"frac must be in (0, 1], got {frac}")
    mask = as_bool_mask(mask, token_adv)
    a = torch.where(mask, token_adv.detach().double().abs(), torch.zeros_like(token_adv, dtype=torch.float64))
    count = mask.sum(dim=-1)
    k = (frac * count.double()).floor().long().clamp_min(1)
    ordered = a.sort(dim=-1, descending=True).values
    rank = torch.arange(a.shape[-1], device=a.device)
    top = torch.where(rank < k.unsqueeze(-1), ordered, torch.zeros_like(ordered)).sum(dim=-1)
    total = a.sum(dim=-1)
    out = top / total
    return torch.where((count > 0) & (total > 0), out, torch.full_like(out, float("nan"))).float()


def nanmean(x: torch.Tensor) -> torch.Tensor:
    """Mean of the finite entries; 0 when there are none."""
    ok = torch.isfinite(x)
    return x[ok].mean() if ok.any() else x.new_zeros(())


def credit_metrics(weights: torch.Tensor, token_adv: torch.Tensor, mask: torch.Tensor,
                   seq_adv: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Scalar metrics of one batch's credit assignment.

    With ``seq_adv`` only sequences with a non-zero advantage count (the ones the update sees).
    """
    mask = as_bool_mask(mask, weights)
    if seq_adv is not None:
        mask = mask & (seq_adv != 0).unsqueeze(-1)
    w = weights.detach().float()
    row_max = torch.where(mask, w, torch.full_like(w, float("-inf"))).amax(dim=-1)
    row_max = torch.where(mask.any(dim=-1), row_max, torch.full_like(row_max, float("nan")))
    out = {
        "ess_ratio": nanmean(ess_ratio(w, mask)),
        "top10_mass": nanmean(top_mass(token_adv, mask, 0.1)),
        "frac_boosted": masked_mean((w > 1 + REL_TOL).float(), mask),
        "frac_suppressed": masked_mean((w < 1 - REL_TOL).float(), mask),
        "max_weight": nanmean(row_max),
    }
    if seq_adv is not None:  # the largest share of a wrong rollout's blame on one token
        neg = (seq_adv < 0).to(row_max.device)
        out["max_weight_negative"] = nanmean(torch.where(neg, row_max, torch.full_like(row_max, float("nan"))))
    return out
