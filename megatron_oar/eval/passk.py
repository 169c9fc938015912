"""pass@k: the unbiased estimator of Chen et al. (2021), per problem and per benchmark.

With ``n`` samples of which ``c`` are correct, the probability that at least one of ``k`` samples
drawn without replacement is correct is::

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1 .. n} (1 - k / i)

The product form avoids huge binomials (``n = 1024`` overflows floats as ``C(n, k)``) and is what
verl, lighteval and the Codex paper's reference code compute. pass@1 is ``c / n`` (the mean
accuracy over the samples, often called avg@n); pass@n is 1 as soon as one sample is correct.
A benchmark's pass@k is the mean over its problems (each may have its own ``n``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError(f"pass@k: {name} must be an integer, got {value!r}")
    return value


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``n`` samples, ``c`` of them correct (a fraction)."""
    n, c, k = _count("n", n), _count("c", c), _count("k", k)
    if n < 1:
        raise ValueError(f"pass@k: n={n} samples; need at least one")
    if c < 0:
        raise ValueError(f"pass@k: c={c} correct samples is negative")
    if c > n:
        raise ValueError(f"pass@k: c={c} correct samples out of only n={n}")
    if k < 1:
        raise ValueError(f"pass@k: k={k}; k must be >= 1")
    if k > n:
        raise ValueError(f"pass@k: k={k} is larger than the n={n} samples per problem; "
                         f"pass@{k} needs at least {k} samples")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean pass@k over problems given as ``(n, c)`` pairs (a fraction in [0, 1])."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("pass@k: no problems to average over")
    return sum(values) / len(values)


def pass_at_ks(counts: Sequence[tuple[int, int]], ks: Iterable[int]) -> dict[int, float]:
    """``{k: mean pass@k}`` for each ``k`` (fractions)."""
    return {k: mean_pass_at_k(counts, k) for k in ks}
