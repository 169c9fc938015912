"""PPO clipped surrogate with token-level advantages (paper Eqs. 3 and 18).

Per valid token, with ``rho = exp(logp - old_logp)``::

    pg_t = max(-A_t * rho, -A_t * clip(rho, 1 - clip_low, 1 + clip_high))      (Eq. 18, negated)
    pg_t = min(pg_t, -A_t * dual_clip)   where A_t < 0, when dual_clip is set (Ye et al. 2020)

``clip_high > clip_low`` is DAPO's clip-higher. Optional terms: ``kl_coef * k3`` with
``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's unbiased, non-negative estimator of
KL(pi || pi_ref)), and ``- entropy_coef * H_t``.

The loss takes log-prob tensors, not logits, so vocab-parallel log-probs computed inside
Megatron's schedule plug straight in. Aggregation over tokens (``agg``):

``token_mean``               sum_t,i l / #tokens                               (DAPO)
``seq_mean_token_mean``      mean_i (sum_t l / T_i)                             (GRPO)
``seq_mean_token_sum_norm``  mean_i (sum_t l / norm_len)                        (Dr.GRPO)

Micro-batching and data parallelism: pass the *global* ``num_tokens`` / ``num_seqs`` of the
whole mini-batch. Then each micro-batch returns its share, and the sum of the micro-batch losses
(and of their gradients, summed over DP ranks) is exactly the loss of the whole mini-batch.
Without them the counts are the local ones, which is right for a single micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_oar.algorithms.masking import as_bool_mask, check_2d, masked_mean, masked_sum

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: bounds rho so a stale or broken log-prob cannot overflow


@dataclass
class PolicyLossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO clip-higher; set equal to clip_low for symmetric PPO
    dual_clip: float | None = None  # c > 1 (e.g. 3.0) bounds the loss of A < 0 tokens at -c * A
    agg: str = "token_mean"
    norm_len: int | None = None  # Dr.GRPO's constant; default: the tensor's T (set max_new_tokens)
    kl_coef: float = 0.0  # k3 KL to the reference policy (needs ref_logprobs)
    entropy_coef: float = 0.0  # entropy bonus (needs entropy with grad)

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"loss agg must be one of {AGGREGATIONS}, got {self.agg!r}")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.norm_len is not None and self.norm_len < 1:
            raise ValueError(f"norm_len must be >= 1, got {self.norm_len}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str, *, num_tokens: int | None = None,
              num_seqs: int | None = None, norm_len: int | None = None) -> torch.Tensor:
    """Reduce per-token ``values [B, T]`` to a scalar by ``agg`` (see module docstring).

    ``num_tokens`` / ``num_seqs`` default to this batch's valid tokens / non-empty rows; rows
    without valid tokens never contribute.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"loss agg must be one of {AGGREGATIONS}, got {agg!r}")
    mask = as_bool_mask(mask, values)
    if agg == "token_mean":
        denom = int(mask.sum()) if num_tokens is None else num_tokens
        return masked_sum(values, mask) / max(denom, 1)
    per_seq = masked_sum(values, mask, dim=-1)
    if agg == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp_min(1).to(values.dtype)
    else:
        per_seq = per_seq / (norm_len or values.shape[-1])
    denom = int(mask.any(dim=-1).sum()) if num_seqs is None else num_seqs
    return per_seq.sum() / max(denom, 1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token ``exp(ref - logp) - (ref - logp) - 1`` >= 0 (estimates KL(pi || pi_ref))."""
    d = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, cfg: PolicyLossConfig, *, ref_logprobs: torch.Tensor | None = None,
                  entropy: torch.Tensor | None = None, num_tokens: int | None = None,
                  num_seqs: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eq. 18 loss (to minimise) and detached statistics.

    Inputs are ``[B, T]``: ``logprobs`` of the taken tokens under the current policy (with grad),
    ``old_logprobs`` under the rollout policy theta_old, token ``advantages``, and ``mask``.
    Statistics (token means over the valid tokens of this batch): ``pg_loss``, ``clip_frac``
    (tokens whose gradient the clip removed), ``clip_frac_low/high``, ``dual_clip_frac``,
    ``approx_kl`` (k3 estimate of KL(pi_old || pi)), ``ratio_mean/max``, and ``ref_kl`` and
    ``entropy`` when given.
    """
    check_2d(logprobs, "logprobs")
    mask = as_bool_mask(mask, logprobs)
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("ref_logprobs", ref_logprobs), ("entropy", entropy)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logprobs.shape)}")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")

    adv = advantages.detach().to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)

    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_len=cfg.norm_len)
    loss = aggregate(pg, mask, cfg.agg, **counts)
    stats = {}
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs.detach())
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg.agg, **counts)
        stats["ref_kl"] = masked_mean(kl.detach(), mask)
    if entropy is not None:
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.agg, **counts)
        stats["entropy"] = masked_mean(entropy.detach(), mask)

    with torch.no_grad():
        clip_active = clipped > unclipped  # the clipped branch won: gradient zero through rho
        low = clip_active & (ratio < 1.0)
        stats.update(
            pg_loss=masked_mean(pg, mask),
            clip_frac=masked_mean(clip_active.to(pg.dtype), mask),
            clip_frac_low=masked_mean(low.to(pg.dtype), mask),
            clip_frac_high=masked_mean((clip_active & ~low).to(pg.dtype), mask),
            dual_clip_frac=masked_mean(dual.to(pg.dtype), mask),
            approx_kl=masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask),
            ratio_mean=masked_mean(ratio, mask),
            ratio_max=torch.where(mask, ratio, torch.zeros_like(ratio)).amax() if mask.any()
            else ratio.new_zeros(()),
        )
    return loss, {k: v.detach() for k, v in stats.items()}
