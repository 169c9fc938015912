"""The causal oracle against the pivots a task builds in: does the oracle confirm them?

On the chain tasks (``data/chain.py``) every response token is a pivot by construction (an
operator word or a digit before the answer tag, :func:`~megatron_oar.data.chain.token_pivots`)
or not (filler, spaces, periods). :func:`confirmation` compares that with the oracle's labels
(``oar analyze oracle``'s records: 1 where substituting the token flips a correct answer), over
the scored tokens of the labelled records:

* ``pivot_share``: constructed pivots / scored tokens (the testbed's design figure);
* ``oracle_share``: oracle pivots / scored tokens (what the model's behaviour makes of it);
* ``flip_rate_pivots`` / ``flip_rate_other``: the share of constructed pivots, and of the other
  scored tokens, that the oracle labels (confirmed: the first well above the second);
* ``oracle_on_pivots``: the share of the oracle's pivots that are constructed pivots.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_oar.data.chain import token_pivots
from megatron_oar.eval.records import TokenRecord


def confirmation(records: Iterable[TokenRecord]) -> dict:
    """The figures above (NaN where a denominator is 0) and their counts."""
    n = {"trajectories": 0, "scored_tokens": 0, "pivots": 0, "oracle_pivots": 0,
         "oracle_on_pivots_count": 0}
    for r in records:
        if r.oracle is None:
            continue
        n["trajectories"] += 1
        built = token_pivots(r.tokens)
        for on, piv, label in zip(r.scored_mask, built, r.oracle):
            if not on:
                continue
            n["scored_tokens"] += 1
            n["pivots"] += piv
            n["oracle_pivots"] += bool(label)
            n["oracle_on_pivots_count"] += bool(label) and piv

    def ratio(a: int, b: int) -> float:
        return a / b if b else float("nan")

    other = n["scored_tokens"] - n["pivots"]
    return {**n, "pivot_share": ratio(n["pivots"], n["scored_tokens"]),
            "oracle_share": ratio(n["oracle_pivots"], n["scored_tokens"]),
            "flip_rate_pivots": ratio(n["oracle_on_pivots_count"], n["pivots"]),
            "flip_rate_other": ratio(n["oracle_pivots"] - n["oracle_on_pivots_count"], other),
            "oracle_on_pivots": ratio(n["oracle_on_pivots_count"], n["oracle_pivots"])}
