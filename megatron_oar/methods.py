"""The one vocabulary of credit methods: the config's ``credit``, ``oar repro``'s runs, the
oracle's token scorers, ``oar bench attribution``, tables and plots all use these names.

    grpo             the sequence advantage on every response token (GRPO)
    random           uniform random token weights, sum-preserving (the paper's diagnostic)
    entropy          the entropy bonus of Cheng et al. (Eq. 6)
    oar_g            OAR with OAR-G importance (noisy embeddings, one input-gradient backward)
    oar_p            OAR with OAR-P importance (mask each token, re-run, KL to the clean probe)
    oar_p_screened   OAR-P on the tokens OAR-G ranks highest, OAR-G's order elsewhere

The last three run the attribution passes and reshape with OAR's bi-level weights (shaping
scheme ``oar``); the first three are shaping schemes of their own.
"""

from __future__ import annotations

CREDIT_METHODS = ("grpo", "random", "entropy", "oar_g", "oar_p", "oar_p_screened")
ATTRIBUTION_METHODS = ("oar_g", "oar_p", "oar_p_screened")
LABELS = {"grpo": "GRPO", "random": "Random", "entropy": "Entropy", "oar_g": "OAR-G", "oar_p": "OAR-P",
          "oar_p_screened": "OAR-P screened"}


def shaping_scheme(method: str) -> str:
    """The advantage-shaping scheme (``ShapingConfig.scheme``) of a credit method."""
    if method not in CREDIT_METHODS:
        raise ValueError(f"unknown credit method {method!r}; expected one of {', '.join(CREDIT_METHODS)}")
    return "oar" if method in ATTRIBUTION_METHODS else method
