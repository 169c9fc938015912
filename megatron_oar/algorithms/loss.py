"""Policy losses with token-level advantages: PPO-clip (paper Eqs. 3 and 18), GSPO, GSPO-token, CISPO.

Per valid token t of sequence i, with ``r_t = exp(logp_t - old_logp_t)``, token advantage
``A_t`` and ``sg`` the stop-gradient (``loss.policy_loss``)::

    ppo_clip    l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))           (Eq. 18)
    gspo        s_i = exp(mean_{t in i} log r_t)                                  (Zheng et al. 2025)
                l_t = max(-A_i s_i, -A_i clip(s_i, 1 - gspo_clip_low, 1 + gspo_clip_high)),
                A_i = the mean of A_t over i (one advantage per sequence; the config refuses
                credit schemes that vary it, docs/algorithms.md)
    gspo_token  s_it = sg(s_i) * pi(y_t) / sg(pi(y_t))   (value s_i, gradient s_i grad log pi(y_t))
                l_t = max(-A_t s_it, -A_t clip(s_it, 1 - gspo_clip_low, 1 + gspo_clip_high))
    cispo       l_t = -sg(clip(r_t, 1 - cispo_clip_low, 1 + cispo_clip_high)) A_t logp_t    (MiniMax-M1)

``dual_clip`` (Ye et al. 2020, ppo_clip / gspo / gspo_token) bounds the loss of ``A < 0`` at
``-A * dual_clip``. ``clip_high > clip_low`` is DAPO's clip-higher; GSPO's defaults are the
paper's 3e-4 / 4e-4 (its ratio is a per-token geometric mean, so near 1); CISPO's are the weight
range ``[0, 5]``: no lower bound (``1 - 1.0 = 0``; MiniMax-M1 sets none) and an upper bound of 5
(SkyRL's defaults, ``cispo_eps_clip_low`` 0 / ``cispo_eps_clip_high`` 5, are ``[1, 6]``:
``loss.cispo_clip_low=0 loss.cispo_clip_high=5`` here). With ``A`` constant over a sequence and
``seq_mean_token_mean`` aggregation, gspo_token has gspo's value and gradient.

``loss.rollout_correction`` (``algorithms.rollout_correction``: TIS, MIS, IcePop) multiplies each
``l_t`` by the detached trainer-vs-rollout weight before aggregation. Optional terms:
``kl_coef * k3`` with ``k3 = exp(ref - logp) - (ref - logp) - 1`` (Schulman's unbiased,
non-negative estimator of KL(pi || pi_ref)), and ``- entropy_coef * H_t``.

The loss takes log-prob tensors, not logits, so vocab-parallel log-probs computed inside
Megatron's schedule plug straight in. Aggregation over tokens (``agg``):

``token_mean``               sum_t,i l / #tokens                               (DAPO)
``seq_mean_token_mean``      mean_i (sum_t l / T_i)                             (GRPO, GSPO)
``seq_mean_token_sum_norm``  mean_i (sum_t l / norm_len)                        (Dr.GRPO)

Micro-batching and data parallelism: pass the *global* ``num_tokens`` / ``num_seqs`` of the
whole mini-batch. Then each micro-batch returns its share, and the sum of the micro-batch losses
(and of their gradients, summed over DP ranks) is exactly the loss of the whole mini-batch.
Without them the counts are the local ones, which is right for a single micro-batch. The
sequence-level quantities (GSPO's ``s_i``, a sequence-level rollout correction) need all of a
sequence's tokens in one call: micro-batches hold whole rows (``models.micro_batches``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_oar.algorithms.masking import as_bool_mask, check_2d, masked_mean, masked_sum
from megatron_oar.algorithms.rollout_correction import check_correction, rollout_weights

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
POLICY_LOSSES = ("ppo_clip", "gspo", "gspo_token", "cispo")
SEQUENCE_ADVANTAGE_LOSSES = ("gspo",)  # one advantage per sequence: token credit would be averaged away
MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: bounds rho so a stale or broken log-prob cannot overflow


@dataclass
class PolicyLossConfig:
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo | gspo_token | cispo
    clip_low: float = 0.2    # ppo_clip
    clip_high: float = 0.28  # ppo_clip: DAPO clip-higher; set equal to clip_low for symmetric PPO
    gspo_clip_low: float = 3e-4   # gspo, gspo_token: the GSPO paper's sequence-ratio clip range
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 1.0   # cispo: the IS weight's lower bound 1 - 1.0 = 0 (none, as MiniMax-M1)
    cispo_clip_high: float = 4.0  # cispo: upper bound 1 + 4 = 5
    dual_clip: float | None = None  # c > 1 (e.g. 3.0) bounds the loss of A < 0 tokens at -c * A
    agg: str = "token_mean"
    norm_len: int | None = None  # Dr.GRPO's constant; default: the tensor's T (set max_new_tokens)
    kl_coef: float = 0.0  # k3 KL to the reference policy (needs ref_logprobs)
    entropy_coef: float = 0.0  # entropy bonus (needs entropy with grad)
    rollout_correction: str = "none"  # none | tis | mis | icepop (algorithms/rollout_correction.py)
    rollout_correction_level: str = "token"  # token | sequence
    rollout_correction_low: float | None = None   # null: the mode's default (tis 0, mis/icepop 0.5)
    rollout_correction_high: float | None = None  # null: the mode's default (tis/mis 2, icepop 5)

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"loss.policy_loss={self.policy_loss!r}: expected one of {list(POLICY_LOSSES)}")
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"loss agg must be one of {AGGREGATIONS}, got {self.agg!r}")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if not (0 <= self.gspo_clip_low < 1) or self.gspo_clip_high < 0:
            raise ValueError(f"loss.gspo_clip_low={self.gspo_clip_low}, loss.gspo_clip_high="
                             f"{self.gspo_clip_high}: need 0 <= gspo_clip_low < 1 and gspo_clip_high >= 0")
        if not (0 <= self.cispo_clip_low <= 1) or self.cispo_clip_high <= 0:
            raise ValueError(f"loss.cispo_clip_low={self.cispo_clip_low}, loss.cispo_clip_high="
                             f"{self.cispo_clip_high}: need 0 <= cispo_clip_low <= 1 (1: no lower "
                             "bound) and cispo_clip_high > 0")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.dual_clip is not None and self.policy_loss == "cispo":
            raise ValueError("loss.dual_clip bounds a clipped surrogate; loss.policy_loss=cispo has "
                             "none (its IS weight is clipped, the gradient never zeroed): set "
                             "loss.dual_clip=null")
        if self.norm_len is not None and self.norm_len < 1:
            raise ValueError(f"norm_len must be >= 1, got {self.norm_len}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        check_correction(self.rollout_correction, self.rollout_correction_level,
                         self.rollout_correction_low, self.rollout_correction_high)


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


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float,
             dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, clip_active, dual_active)`` of the clipped surrogate ``max(-A r, -A clip(r))``
    (then the dual clip); ``clip_active``: the clipped branch won (zero gradient through r)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    pg = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(pg, dtype=torch.bool)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)
    return pg, (clipped > unclipped).detach(), dual


def _surrogate(logprobs: torch.Tensor, log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               cfg: PolicyLossConfig):
    """``(l [B, T], the ratio the loss uses [B, T], clip_active, clip_low_side, dual_active)``."""
    if cfg.policy_loss == "ppo_clip":
        ratio = torch.exp(log_ratio)
        pg, active, dual = _clipped(ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        return pg, ratio, active, active & (ratio < 1.0), dual
    if cfg.policy_loss == "cispo":
        ratio = torch.exp(log_ratio)
        lo, hi = 1.0 - cfg.cispo_clip_low, 1.0 + cfg.cispo_clip_high
        weight = ratio.detach().clamp(lo, hi)
        pg = -weight * adv * logprobs
        low = ratio.detach() < lo
        return pg, ratio, low | (ratio.detach() > hi), low, torch.zeros_like(low)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)  # [B, 1]: log s_i
    if cfg.policy_loss == "gspo":
        seq_adv = masked_mean(adv, mask, dim=-1).unsqueeze(-1)
        ratio = torch.exp(seq_log_ratio)
        pg, active, dual = _clipped(ratio, seq_adv, cfg.gspo_clip_low, cfg.gspo_clip_high, cfg.dual_clip)
        return tuple(t.expand_as(log_ratio) for t in (pg, ratio, active, active & (ratio < 1.0), dual))
    # gspo_token: value s_i on every token, gradient s_i * grad log pi(y_t); the verl ordering
    # (the detached terms added last) keeps the value exact
    log_s = (logprobs - logprobs.detach() + seq_log_ratio.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_s)
    pg, active, dual = _clipped(ratio, adv, cfg.gspo_clip_low, cfg.gspo_clip_high, cfg.dual_clip)
    return pg, ratio, active, active & (ratio < 1.0), dual


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cfg: PolicyLossConfig, *, rollout_logprobs: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                num_tokens: int | None = None,
                num_seqs: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``cfg.policy_loss``'s loss (to minimise) and detached statistics.

    Inputs are ``[B, T]``: ``logprobs`` of the taken tokens under the current policy (with grad),
    ``old_logprobs`` under theta_old (the trainer's old-logprob pass), token ``advantages``,
    ``mask``, and vLLM's ``rollout_logprobs`` (needed by ``cfg.rollout_correction``; they also
    give the mismatch statistics). Statistics (token means over the valid tokens of this batch):
    ``pg_loss``, ``clip_frac`` (tokens whose ratio the clip bounded: no gradient through it for
    the clipped surrogates, a clipped weight for cispo), ``clip_frac_low/high``,
    ``dual_clip_frac``, ``approx_kl`` (k3 estimate of KL(pi_old || pi)), ``ratio_mean/max`` (of
    the ratio the loss uses: GSPO's sequence ratio for gspo / gspo_token), ``ref_kl`` and
    ``entropy`` when given, and with ``rollout_logprobs`` the correction's
    (``rollout_correction.STAT_KEYS``).
    """
    check_2d(logprobs, "logprobs")
    mask = as_bool_mask(mask, logprobs)
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("rollout_logprobs", rollout_logprobs), ("ref_logprobs", ref_logprobs),
                    ("entropy", entropy)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logprobs.shape)}")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs entropy")
    if cfg.rollout_correction != "none" and rollout_logprobs is None:
        raise ValueError(f"loss.rollout_correction={cfg.rollout_correction!r} needs rollout_logprobs")

    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(mask, logprobs, zero)  # padding (anything, even NaN) never reaches a gradient
    adv = torch.where(mask, advantages.detach().to(logprobs.dtype), zero)
    log_ratio = (logprobs - torch.where(mask, old_logprobs.detach().to(logprobs.dtype), zero)).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO)
    pg, ratio, clip_active, low, dual = _surrogate(logprobs, log_ratio, adv, mask, cfg)
    stats = {}
    if rollout_logprobs is not None:
        weights, stats = rollout_weights(
            old_logprobs, rollout_logprobs, mask, cfg.rollout_correction, level=cfg.rollout_correction_level,
            low=cfg.rollout_correction_low, high=cfg.rollout_correction_high)
        if cfg.rollout_correction != "none":
            pg = pg * weights.to(pg.dtype)

    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_len=cfg.norm_len)
    loss = aggregate(pg, mask, cfg.agg, **counts)
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
        ratio = ratio.detach()
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
