"""GRPO objective and OAR credit assignment, in plain torch (no Megatron needed).

- :mod:`.advantages`  group-relative sequence advantages (Eq. 2)
- :mod:`.oar`         importance -> normalised (Eq. 14) -> bi-level weights (Eqs. 16-17) -> A_t (Eq. 15)
- :mod:`.credit`      the credit schemes: grpo, random, entropy (Eq. 6), oar
- :mod:`.loss`        policy losses with token-level advantages: PPO-clip (Eq. 18), GSPO, GSPO-token, CISPO
- :mod:`.rollout_correction`  trainer-vs-rollout importance weights: TIS, MIS, IcePop
- :mod:`.metrics`     ESS ratio (Eq. 27), top-10% advantage mass (Eq. 28), boosted/suppressed
"""

from megatron_oar.algorithms.advantages import constant_groups, group_advantages
from megatron_oar.algorithms.credit import Credit, ShapingConfig, assign_credit
from megatron_oar.algorithms.loss import PolicyLossConfig, aggregate, policy_loss
from megatron_oar.algorithms.metrics import credit_metrics, ess_ratio, top_mass
from megatron_oar.algorithms.oar import bilevel_weights, normalize_importance, reshape_advantages

__all__ = [
    "Credit", "ShapingConfig", "PolicyLossConfig", "aggregate", "assign_credit", "bilevel_weights",
    "constant_groups", "credit_metrics", "ess_ratio", "group_advantages", "normalize_importance",
    "policy_loss", "reshape_advantages", "top_mass",
]
