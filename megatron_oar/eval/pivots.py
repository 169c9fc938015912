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

With the oracle's control decode (``oar analyze oracle --control``: ``kept_correct``, whether
greedy decoding after the token itself still verifies) a label counts as **caused** only where
that control verifies (the substitution, not the model's own continuation, made the answer
wrong): ``kept_share`` (scored tokens whose control verifies), ``caused_share`` (caused pivots /
scored tokens), ``caused_flip_rate_pivots`` / ``caused_flip_rate_other`` (among the constructed
pivots, and the other tokens, whose control verifies) and ``caused_on_pivots``; NaN without it.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_oar.data.chain import token_pivots
from megatron_oar.eval.records import TokenRecord


def confirmation(records: Iterable[TokenRecord]) -> dict:
    """The figures above (NaN where a denominator is 0) and their counts."""
    n = {"trajectories": 0, "scored_tokens": 0, "pivots": 0, "oracle_pivots": 0,
         "oracle_on_pivots_count": 0, "controlled_tokens": 0, "kept": 0, "kept_pivots": 0,
         "caused": 0, "caused_on_pivots_count": 0}
    for r in records:
        if r.oracle is None:
            continue
        n["trajectories"] += 1
        built = token_pivots(r.tokens)
        kept = r.kept_correct if r.kept_correct is not None else [None] * len(r.oracle)
        for on, piv, label, ok in zip(r.scored_mask, built, r.oracle, kept):
            if not on:
                continue
            n["scored_tokens"] += 1
            n["pivots"] += piv
            n["oracle_pivots"] += bool(label)
            n["oracle_on_pivots_count"] += bool(label) and piv
            if ok is None:
                continue
            n["controlled_tokens"] += 1
            n["kept"] += bool(ok)
            n["kept_pivots"] += bool(ok) and piv
            n["caused"] += bool(ok) and bool(label)
            n["caused_on_pivots_count"] += bool(ok) and bool(label) and piv

    def ratio(a: int, b: int) -> float:
        return a / b if b else float("nan")

    other = n["scored_tokens"] - n["pivots"]
    return {**n, "pivot_share": ratio(n["pivots"], n["scored_tokens"]),
            "oracle_share": ratio(n["oracle_pivots"], n["scored_tokens"]),
            "flip_rate_pivots": ratio(n["oracle_on_pivots_count"], n["pivots"]),
            "flip_rate_other": ratio(n["oracle_pivots"] - n["oracle_on_pivots_count"], other),
            "oracle_on_pivots": ratio(n["oracle_on_pivots_count"], n["oracle_pivots"]),
            "kept_share": ratio(n["kept"], n["controlled_tokens"]),
            "caused_share": ratio(n["caused"], n["controlled_tokens"]),
            "caused_flip_rate_pivots": ratio(n["caused_on_pivots_count"], n["kept_pivots"]),
            "caused_flip_rate_other": ratio(n["caused"] - n["caused_on_pivots_count"],
                                            n["kept"] - n["kept_pivots"]),
            "caused_on_pivots": ratio(n["caused_on_pivots_count"], n["caused"])}
