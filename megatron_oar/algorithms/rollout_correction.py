"""Rollout correction: the trainer-vs-rollout importance weight on the policy loss.

vLLM samples the responses with its own kernels (and, on a MoE model, its own routing), so its
log-probs of the sampled tokens differ a little from the trainer's under the same weights
theta_old; the update then trains off-policy without knowing it. The correction weighs each
token's policy loss by (the ``loss.rollout_correction*`` keys)::

    token level     rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_logp_t - rollout_logp_t)
    sequence level  rho_i = prod_t rho_t = exp(sum_t (old_logp_t - rollout_logp_t)), on every token of i

``old_logp`` is the trainer's old-logprob pass (Megatron, theta_old), ``rollout_logp`` vLLM's
log-probs of the same tokens (``TrainBatch.rollout_logprobs``). With bounds ``[low, high]``:

=========== ======================================================= ======================
mode        weight (detached)                                       default ``[low, high]``
=========== ======================================================= ======================
``tis``     ``clip(rho, low, high)`` (truncated IS)                  ``[0, 2]``
``mis``     ``rho`` inside ``[low, high]``, 0 outside (masked IS)    ``[0.5, 2]``
``icepop``  as ``mis``, token level only, IcePop's bounds            ``[0.5, 5]``
=========== ======================================================= ======================

References: TIS, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (verl ``tis_imp_ratio_cap``, slime ``--use-tis --tis-clip 2 --tis-clip-low 0``); MIS,
Liu et al. 2025, "When Speed Kills Stability" (verl's rollout correction, slime's MIS, masked IS
at token or sequence level); IcePop, Ling Team 2025, "Small Leak Can Sink a Great Ship" (token
mask ``M(k) = k`` for ``k`` in ``[0.5, 5]``, else 0; NeMo-RL's ICE-POP). A masked token keeps its
place in the loss's token and sequence counts (it contributes 0), as IcePop's
``1/|y| sum_t M(k_t) ...`` does, so the loss stays exact over micro-batches and DP ranks.

Sequence level needs every token of a sequence in one micro-batch: the trainer's micro-batches
hold whole rows (``models.micro_batches``), so it has them.
"""

from __future__ import annotations

import torch

from megatron_oar.algorithms.masking import masked_mean

CORRECTIONS = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence")
DEFAULT_BOUNDS = {"tis": (0.0, 2.0), "mis": (0.5, 2.0), "icepop": (0.5, 5.0)}
MAX_LOG_WEIGHT = 20.0  # exp(20) ~ 5e8: a broken log-prob cannot overflow the weight
# the loss statistics (loss/<key>) the correction adds; the same keys whatever the mode
STAT_KEYS = ("mismatch_kl", "mismatch_k1", "rollout_is_weight_mean", "rollout_truncated_frac",
             "rollout_masked_frac")


def correction_bounds(mode: str, low: float | None, high: float | None) -> tuple[float, float]:
    """``(low, high)``: the configured bounds, each defaulting to ``mode``'s (table above)."""
    lo, hi = DEFAULT_BOUNDS[mode]
    return (lo if low is None else low), (hi if high is None else high)


def check_correction(mode: str, level: str, low: float | None, high: float | None) -> None:
    """A ``ValueError`` naming the ``loss.rollout_correction*`` key that cannot work."""
    if mode not in CORRECTIONS:
        raise ValueError(f"loss.rollout_correction={mode!r}: expected one of {list(CORRECTIONS)}")
    if level not in LEVELS:
        raise ValueError(f"loss.rollout_correction_level={level!r}: expected one of {list(LEVELS)}")
    if mode == "none":
        return
    if mode == "icepop" and level != "token":
        raise ValueError("loss.rollout_correction=icepop is a token-level mask (IcePop's M(k)); "
                         "loss.rollout_correction_level=sequence masks whole sequences: use "
                         "loss.rollout_correction=mis with it")
    lo, hi = correction_bounds(mode, low, high)
    if not 0 <= lo < hi:
        raise ValueError(f"loss.rollout_correction_low={low} / loss.rollout_correction_high={high} "
                         f"(resolved {lo}, {hi} for {mode}): need 0 <= low < high")


def rollout_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                    mode: str, *, level: str = "token", low: float | None = None,
                    high: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(weights [B, T], stats)``: the detached correction weight of every token (1 with
    ``mode='none'``; 0 on padding) and token means over ``mask`` of this batch:
    ``mismatch_kl`` (k3 estimate of KL(pi_rollout || pi_old): ``exp(d) - d - 1`` with
    ``d = old - rollout``), ``mismatch_k1`` (mean ``rollout - old``), ``rollout_is_weight_mean``,
    and the share of tokens whose weight was truncated (``tis``) or masked (``mis``/``icepop``)."""
    mask = mask.bool()
    with torch.no_grad():
        zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
        # clamped: a -inf log-prob from vLLM (a token outside processed top-k) stays finite
        d = torch.where(mask, old_logprobs.detach() - rollout_logprobs.detach().to(old_logprobs.dtype),
                        zero).clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)
        stats = {"mismatch_kl": masked_mean(torch.exp(d) - d - 1, mask), "mismatch_k1": masked_mean(-d, mask)}
        truncated = masked = torch.zeros_like(mask)
        if mode == "none":
            weights = mask.to(old_logprobs.dtype)
        else:
            log_w = d.sum(dim=-1, keepdim=True).expand_as(d) if level == "sequence" else d
            rho = torch.exp(log_w.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
            lo, hi = correction_bounds(mode, low, high)
            outside = ((rho < lo) | (rho > hi)) & mask
            if mode == "tis":
                weights, truncated = rho.clamp(lo, hi), outside
            else:
                weights, masked = torch.where(outside, zero, rho), outside
            weights = torch.where(mask, weights, zero)
        stats.update(rollout_is_weight_mean=masked_mean(weights, mask),
                     rollout_truncated_frac=masked_mean(truncated.to(d.dtype), mask),
                     rollout_masked_frac=masked_mean(masked.to(d.dtype), mask))
    return weights, stats
