"""The credit schemes and settings that ``oar analyze lookahead`` (``repro/lookahead.py``) and
``oar repro --grid credit-ablations`` (``repro/runner.py``) compare: each arm's config overrides
(issue 54). Their own module so that both read them without importing each other."""

from __future__ import annotations

# arm -> config overrides. The paper's Table 3 and the authors' choices on OAR-G, and our
# sign-aware variant (shaping.variant, docs/algorithms.md). The LT-Logits warm-up for the
# answer_mean probe (paper Sec. 6.2) runs the last_token probe for its first steps; its length is
# not given in the paper: 3 steps here (in a 1-step lookahead, every step)
ARMS: dict[str, tuple[str, ...]] = {
    "grpo": ("credit=grpo",),
    "random": ("credit=random",),
    "entropy": ("credit=entropy",),
    "oar_g": ("credit=oar_g",),
    "oar_p_screened": ("credit=oar_p_screened",),
    "oar_p": ("credit=oar_p",),
    "oar_g tau=0 (boost-only)": ("credit=oar_g", "shaping.tau=0.0"),
    "oar_g tau=1 (suppress-only)": ("credit=oar_g", "shaping.tau=1.0"),
    "oar_g beta=0 (no boost)": ("credit=oar_g", "shaping.beta=0.0"),
    "oar_g floor=0.1 (authors' code)": ("credit=oar_g", "shaping.floor=0.1"),
    "oar_g LT-Logits warm-up": ("credit=oar_g", "attribution.probe.warmup_steps=3"),
    "oar_g sign_aware (ours)": ("credit=oar_g", "shaping.variant=sign_aware"),
}
