"""Token credit schemes: a sequence advantage ``A_i`` and a response mask -> token advantages.

========== ================================================================================
scheme     token advantage ``A_t`` (weights ``w_t = A_t / A_i``)
========== ================================================================================
``grpo``    ``A_i`` on every valid token (GRPO's broadcast, Eq. 3)
``random``  ``A_i * w_t`` with ``w ~ U(0, 1)`` renormalised to sum T (the paper's diagnostic)
``entropy`` ``A_i + min(alpha * sg(H_t), |A_i| / kappa)`` (Cheng et al., Eq. 6): a bonus >= 0, no mass kept; kappa > 1
``oar``     ``A_i * w_t`` with OAR's bi-level weights from importance scores (Eqs. 14-17)
========== ================================================================================

``variant="sign_aware"`` (ours, not the paper's) applies the ``oar`` weights only to rows with
``A_i > 0``; rows with ``A_i < 0`` get GRPO's uniform weights. Disabling only the boost on those
rows could not keep the paper's sum ``T * A_i``: with some tokens suppressed below 1 and none
above, the weights sum to less than T, and the renormalisation that restores T lifts the
unsuppressed tokens above 1 again (a boost by another name). Uniform weights keep the sum exactly.

The attribution method (OAR-G or OAR-P) only changes where the importance comes from; both use
the ``oar`` scheme here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_oar.algorithms import oar
from megatron_oar.algorithms.masking import as_bool_mask, check_2d, check_finite, sub_mask

SCHEMES = ("grpo", "random", "entropy", "oar")
# how ``oar`` applies its weights: ``paper`` on every row (Eqs. 14-17); ``sign_aware`` (ours, not the
# paper's) only on rows with a positive sequence advantage, GRPO's uniform weights elsewhere
VARIANTS = ("paper", "sign_aware")


@dataclass
class ShapingConfig:
    """Options of every scheme; each scheme reads only its own."""

    scheme: str = "oar"
    # oar (Eqs. 14-17): the paper's tau = 0.4 (top 60% boosted) and beta = 2.0
    tau: float = 0.4
    beta: float = 2.0
    tau_mode: str = "quantile"  # quantile | value
    # suppression floor: lower bound on suppressed weights before renormalisation. 0 is Eqs. 14-16
    # (the least important token gets 0); the authors' code uses 0.1 (see algorithms/oar.py)
    floor: float = 0.0
    eps: float = 1e-6
    # paper: Eqs. 14-17 on every row | sign_aware (ours): reshape only rows with A_i > 0; rows with
    # A_i < 0 keep GRPO's uniform weights (no boost, and so no suppression: see docs/algorithms.md)
    variant: str = "paper"
    # entropy (Eq. 6): Cheng et al.'s alpha and kappa
    entropy_alpha: float = 0.4
    entropy_kappa: float = 2.0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"credit scheme must be one of {SCHEMES}, got {self.scheme!r}")
        _check_entropy_options(self.entropy_alpha, self.entropy_kappa)
        oar._check_options(self.tau, self.beta, self.tau_mode, self.floor, self.eps)
        if self.variant not in VARIANTS:
            raise ValueError(f"shaping.variant={self.variant!r}: must be one of {list(VARIANTS)}")


def _check_entropy_options(alpha: float, kappa: float) -> None:
    """Eq. 6's bonus ``min(alpha H, |A| / kappa)`` is >= 0: it must stay below ``|A|``, or a
    negative advantage would reach 0 (kappa = 1) or flip its sign (kappa < 1)."""
    if not alpha >= 0:
        raise ValueError(f"shaping.entropy_alpha={alpha}: must be >= 0")
    if not kappa > 1:
        raise ValueError(f"shaping.entropy_kappa={kappa}: must be > 1 (the entropy bonus is capped at "
                         "|A_i| / kappa; at kappa <= 1 it cancels or flips a negative advantage)")


@dataclass
class Credit:
    """Token advantages ``[B, T]`` and the weights they imply (``A_t / A_i``; 1 where A_i = 0)."""

    advantages: torch.Tensor
    weights: torch.Tensor


def random_weights(mask: torch.Tensor, score_mask: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """``w ~ U(0, 1)`` on the scored tokens, renormalised like OAR's weights (Eq. 17)."""
    u = torch.rand(mask.shape, generator=generator, device=mask.device)
    return oar.renormalize(u, mask.bool(), score_mask)


def entropy_advantages(seq_adv: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
                       alpha: float = 0.4, kappa: float = 2.0) -> torch.Tensor:
    """Eq. 6: ``A_t = A + min(alpha * sg(H_t), |A| / kappa)`` on valid tokens, 0 on padding.

    The bonus is non-negative and capped at ``|A| / kappa``: a positive advantage grows by up to
    ``1 / kappa`` of itself, a negative one shrinks by as much, and with kappa > 1 (required) it
    never reaches 0 or flips. Not mass preserving: a row's sum grows by up to ``T |A| / kappa``.
    """
    _check_entropy_options(alpha, kappa)
    check_2d(entropy, "entropy")
    mask = as_bool_mask(mask, entropy)
    check_finite(entropy, mask, "entropy")
    h = entropy.detach().float()
    a = seq_adv.to(h.dtype).unsqueeze(-1)
    shaped = a + torch.minimum(alpha * h, a.abs() / kappa)
    return torch.where(mask, shaped, torch.zeros_like(shaped))


def assign_credit(cfg: ShapingConfig, seq_adv: torch.Tensor, mask: torch.Tensor, *,
                  importance: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                  score_mask: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> Credit:
    """Token advantages for ``cfg.scheme``.

    ``importance`` is required for ``oar``, ``entropy`` for ``entropy``; ``score_mask`` (tokens
    that were scored; others keep weight 1) applies to ``oar`` and ``random``; ``generator``
    seeds ``random``.
    """
    check_2d(mask, "mask")
    if seq_adv.shape != mask.shape[:1]:
        raise ValueError(f"seq_adv has shape {tuple(seq_adv.shape)}, expected ({mask.shape[0]},)")
    valid = mask.bool()
    ones = valid.float()
    if cfg.scheme == "grpo":
        weights = ones
    elif cfg.scheme == "random":
        weights = random_weights(valid, sub_mask(valid, score_mask), generator)
    elif cfg.scheme == "oar":
        if importance is None:
            raise ValueError("credit scheme 'oar' needs importance scores")
        weights = oar.oar_weights(importance, valid, cfg.tau, cfg.beta, cfg.tau_mode, cfg.floor,
                                  cfg.eps, score_mask)
        if cfg.variant == "sign_aware":  # a wrong rollout's blame stays spread as GRPO spreads it
            positive = (seq_adv > 0).to(weights.device).unsqueeze(-1)
            weights = torch.where(positive, weights, ones.to(weights.dtype))
    else:
        if entropy is None:
            raise ValueError("credit scheme 'entropy' needs token entropies")
        adv = entropy_advantages(seq_adv, entropy, valid, cfg.entropy_alpha, cfg.entropy_kappa)
        a = seq_adv.to(adv.dtype).unsqueeze(-1)
        weights = torch.where((a != 0) & valid, adv / torch.where(a == 0, 1.0, a), ones)
        return Credit(adv, weights)
    return Credit(seq_adv.to(weights.dtype).unsqueeze(-1) * weights, weights)
