"""Which of a step's samples each data-parallel rank trains on.

The step's samples form ``train.mini_batches`` contiguous global mini-batches (one optimizer
step each); every DP rank gets the same number of samples of each, and a mini-batch's loss is
normalised by its global token and sequence counts, so any assignment gives the same update up
to floating-point rounding. Two assignments:

* ``balanced`` (``train.balance_dp_tokens``, the default): within each mini-batch, samples
  longest first go to the rank with the fewest tokens so far that still has room (greedy
  longest-processing-time with equal counts), so no rank's passes run all the long responses
  while the others wait at the gradient all-reduce;
* strided: rank ``d`` takes samples ``d, d + DP, ...``.

The assignment is a pure function of the lengths, so every rank computes the same one.
"""

from __future__ import annotations

from collections.abc import Sequence


def dp_assignment(lengths: Sequence[int], dp: int, mini_batches: int = 1,
                  balance: bool = True) -> list[list[int]]:
    """Per DP rank, its sample indices: mini-batch by mini-batch, ascending within each."""
    n = len(lengths)
    if n % (dp * mini_batches):
        raise ValueError(f"{n} samples do not split into {mini_batches} mini-batches x {dp} DP ranks")
    per_mini = n // mini_batches
    ranks: list[list[int]] = [[] for _ in range(dp)]
    for start in range(0, n, per_mini):
        samples = range(start, start + per_mini)
        if not balance:
            for k, i in enumerate(samples):
                ranks[k % dp].append(i)
            continue
        room, load = per_mini // dp, [0] * dp
        share: list[list[int]] = [[] for _ in range(dp)]
        for i in sorted(samples, key=lambda i: (-lengths[i], i)):
            d = min((d for d in range(dp) if len(share[d]) < room), key=lambda d: (load[d], d))
            share[d].append(i)
            load[d] += lengths[i]
        for d in range(dp):
            ranks[d] += sorted(share[d])
    return ranks


def token_imbalance(lengths: Sequence[int], assignment: list[list[int]]) -> float:
    """The most tokens any rank holds over the mean (1.0: perfectly balanced)."""
    loads = [sum(lengths[i] for i in rows) for rows in assignment]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
