"""Outcome-grounded Advantage Reshaping: importance scores -> token weights -> token advantages.

The three steps of the paper, on ``[B, T]`` tensors with a validity ``mask``:

1. :func:`normalize_importance` (Eq. 14): ``I_bar = log(1 + I)``, then per-sequence min-max
   ``I_hat = (I_bar - min) / (max - min + eps)`` over the scored tokens, in ``[0, 1)``.
2. :func:`bilevel_weights` (Eqs. 16-17): the bi-level gate ``omega(I_hat)`` suppresses tokens
   below the threshold (``I_hat / (tau + eps)``) and boosts those at or above it
   (``1 + beta * (I_hat - tau) / (1 - tau + eps)``); it is continuous with ``omega = 1`` at the
   threshold. Then sum-preserving renormalisation ``w = omega * T / sum(omega)``.
3. :func:`reshape_advantages` (Eq. 15): ``A_t = A_i * w_t``.

Threshold (``tau_mode``):

- ``"quantile"`` (default): the threshold is the ``tau``-quantile (linear interpolation, as
  ``torch.quantile``) of the sequence's normalised scores, so ``tau = 0.4`` boosts the top 60% of
  tokens, the paper's setting. ``tau = 0`` puts the threshold at the minimum: every token is
  boosted (boost-only); ``tau = 1`` puts it at the maximum: every token but the top one is
  suppressed (suppress-only), the two ends of the paper's Table 3.
- ``"value"``: ``tau`` itself on the ``[0, 1]`` scale of ``I_hat``. ``tau = 1`` suppresses every
  token (``I_hat < 1`` always); ``tau = 0`` boosts every token.

Suppression floor (``floor``, ``ShapingConfig.floor``): suppressed tokens get
``omega = max(I_hat / (tau + eps), floor)``, before the renormalisation, so the weights still sum
to T (a floored token ends at ``floor * T_s / sum(omega)``). The default, 0, is what Eqs. 14-17
give: Eq. 14 maps each row's least important scored token to ``I_hat = 0`` and Eq. 16 maps
``I_hat = 0`` to ``omega = 0``; neither has a floor term. Appendix A.1.4's "suppression floor" is
the bound ``omega(I_hat_k) <= eps << 1`` on a non-influential token's weight, whose gradient
noise is then ``<= eps^2`` GRPO's and vanishes as ``eps -> 0``: a bound the equations meet with
0, not a floor they add. The authors' released code floors suppressed weights at 0.1
(``floor: 0.1`` reproduces it), so no token's advantage is switched off completely.

Scored and unscored tokens: ``score_mask`` (a subset of ``mask``) names the tokens that were
scored. Valid tokens outside it (for example the answer span, which the probe reads) keep
weight 1, and the renormalisation runs over the scored tokens only, so the weights of all valid
tokens still sum to T.

Defined edge cases: a row with no valid tokens gets weight 0 everywhere; a row whose scored
importances are all equal (including a single scored token) gets uniform weight 1 and is never
NaN; a zero sequence advantage gives zero token advantages; NaN/inf or negative importance on a
valid scored token raises ``ValueError`` naming the rows; padding never influences valid rows.
"""

from __future__ import annotations

import torch

from megatron_oar.algorithms.masking import (
    as_bool_mask,
    check_2d,
    check_finite,
    float_view,
    masked_sum,
    sub_mask,
)

TAU_MODES = ("quantile", "value")
NEGATIVE_TOLERANCE = 1e-6  # KL estimates can come out at -1e-9; anything below this is a bug


def _check_options(tau: float, beta: float, tau_mode: str, floor: float, eps: float) -> None:
    if tau_mode not in TAU_MODES:
        raise ValueError(f"tau_mode must be one of {TAU_MODES}, got {tau_mode!r}")
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must be in [0, 1], got {tau}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")


def normalize_importance(importance: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Eq. 14: ``log1p`` then per-row min-max over the tokens in ``mask``; 0 elsewhere.

    ``importance`` must be finite and non-negative on ``mask`` (a ``ValueError`` names the rows
    otherwise); values down to ``-1e-6`` are rounding noise and are clamped to 0. The result
    is float32 (float64 when the input is) with values in ``[0, 1)``.
    """
    check_2d(importance, "importance")
    mask = as_bool_mask(mask, importance)
    x = float_view(importance)
    check_finite(x, mask, "importance")
    negative = (x < -NEGATIVE_TOLERANCE) & mask
    if negative.any():
        rows = negative.any(dim=-1).nonzero().flatten().tolist()[:8]
        raise ValueError(f"importance must be >= 0; negative values on rows {rows}")
    bar = torch.log1p(torch.where(mask, x.clamp_min(0.0), torch.zeros_like(x)))
    lo = torch.where(mask, bar, torch.full_like(bar, float("inf"))).amin(dim=-1, keepdim=True)
    hi = torch.where(mask, bar, torch.full_like(bar, float("-inf"))).amax(dim=-1, keepdim=True)
    empty = ~mask.any(dim=-1, keepdim=True)
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    return torch.where(mask, (bar - lo) / (hi - lo + eps), torch.zeros_like(bar))


def row_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row ``q``-quantile of ``values`` over ``mask`` (linear interpolation); ``[B, 1]``.

    Equals ``torch.quantile(values[b][mask[b]], q)`` for each row, 0 for empty rows.
    """
    count = mask.sum(dim=-1, keepdim=True)
    ordered = torch.where(mask, values, torch.full_like(values, float("inf"))).sort(dim=-1).values
    pos = q * (count - 1).clamp_min(0).to(values.dtype)
    lo_idx = pos.floor().long()
    hi_idx = pos.ceil().long()
    lo = ordered.gather(-1, lo_idx)
    hi = ordered.gather(-1, hi_idx)
    out = lo + (hi - lo) * (pos - lo_idx.to(values.dtype))
    return torch.where(count > 0, out, torch.zeros_like(out))


def bilevel_gate(norm_importance: torch.Tensor, threshold: torch.Tensor | float, beta: float,
                 eps: float = 1e-6) -> torch.Tensor:
    """The un-normalised gate ``omega`` of Eq. 16, elementwise (threshold broadcasts)."""
    thr = torch.as_tensor(threshold, dtype=norm_importance.dtype, device=norm_importance.device)
    suppress = norm_importance / (thr + eps)
    boost = 1.0 + beta * (norm_importance - thr) / (1.0 - thr + eps)
    return torch.where(norm_importance < thr, suppress, boost)


def gate_threshold(norm_importance: torch.Tensor, mask: torch.Tensor, tau: float,
                   tau_mode: str) -> torch.Tensor:
    """Per-row threshold ``[B, 1]``: the tau-quantile of the row, or tau itself."""
    if tau_mode == "quantile":
        return row_quantile(norm_importance, mask, tau)
    return torch.full((norm_importance.shape[0], 1), tau, dtype=norm_importance.dtype,
                      device=norm_importance.device)


def renormalize(omega: torch.Tensor, mask: torch.Tensor, score_mask: torch.Tensor | None = None,
                eps: float = 1e-12) -> torch.Tensor:
    """Eq. 17 over the scored tokens: scored weights sum to their count, other valid tokens 1.

    A scored row whose weights sum to (almost) zero carries no ranking and becomes uniform.
    """
    mask = as_bool_mask(mask, omega)
    scored = sub_mask(mask, score_mask)
    count = scored.sum(dim=-1, keepdim=True).to(omega.dtype)
    total = masked_sum(omega, scored, dim=-1).unsqueeze(-1)
    degenerate = total <= eps * count.clamp_min(1)
    scaled = torch.where(degenerate, torch.ones_like(omega), omega * count / total.clamp_min(eps))
    ones = torch.ones_like(omega)
    return torch.where(scored, scaled, torch.where(mask, ones, torch.zeros_like(omega)))


def bilevel_weights(norm_importance: torch.Tensor, mask: torch.Tensor, tau: float = 0.4,
                    beta: float = 2.0, tau_mode: str = "quantile", floor: float = 0.0,
                    eps: float = 1e-6, score_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Eqs. 16-17: bi-level gate on normalised importance, then sum-preserving renormalisation.

    Returns ``[B, T]`` weights: on each row the valid (``mask``) weights sum to T, the number of
    valid tokens, and padding is 0. Only ``score_mask`` tokens (default: all of ``mask``) are
    gated and renormalised; other valid tokens keep weight 1. Rows whose scored importances are
    all equal get uniform weights. See the module docstring for ``tau_mode`` and ``floor``.
    """
    check_2d(norm_importance, "norm_importance")
    _check_options(tau, beta, tau_mode, floor, eps)
    mask = as_bool_mask(mask, norm_importance)
    scored = sub_mask(mask, score_mask)
    x = float_view(norm_importance)
    check_finite(x, scored, "norm_importance")
    x = torch.where(scored, x, torch.zeros_like(x))
    thr = gate_threshold(x, scored, tau, tau_mode)
    omega = bilevel_gate(x, thr, beta, eps)
    if floor > 0:
        omega = torch.where(x < thr, omega.clamp_min(floor), omega)
    hi = torch.where(scored, x, torch.full_like(x, float("-inf"))).amax(dim=-1, keepdim=True)
    lo = torch.where(scored, x, torch.full_like(x, float("inf"))).amin(dim=-1, keepdim=True)
    omega = torch.where(hi == lo, torch.ones_like(omega), omega)  # no ranking: uniform
    return renormalize(omega, mask, scored)


def oar_weights(importance: torch.Tensor, mask: torch.Tensor, tau: float = 0.4, beta: float = 2.0,
                tau_mode: str = "quantile", floor: float = 0.0, eps: float = 1e-6,
                score_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Raw importance -> renormalised token weights (Eqs. 14, 16, 17)."""
    scored = sub_mask(as_bool_mask(mask, importance), score_mask)
    norm = normalize_importance(importance, scored, eps)
    return bilevel_weights(norm, mask, tau, beta, tau_mode, floor, eps, score_mask=scored)


def reshape_advantages(seq_adv: torch.Tensor, importance: torch.Tensor, mask: torch.Tensor,
                       tau: float = 0.4, beta: float = 2.0, tau_mode: str = "quantile",
                       floor: float = 0.0, eps: float = 1e-6,
                       score_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 15: token advantages ``A_t = A_i * w_t`` from sequence advantages ``seq_adv [B]``.

    ``sum_t A_t = T * A_i`` on every row, the same total as GRPO's broadcast; padding is 0.
    """
    if seq_adv.shape != importance.shape[:1]:
        raise ValueError(f"seq_adv has shape {tuple(seq_adv.shape)}, expected ({importance.shape[0]},)")
    check_finite(seq_adv, torch.ones_like(seq_adv, dtype=torch.bool), "seq_adv")
    w = oar_weights(importance, mask, tau, beta, tau_mode, floor, eps, score_mask)
    return seq_adv.to(w.dtype).unsqueeze(-1) * w
