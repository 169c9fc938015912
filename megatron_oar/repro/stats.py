"""Means with 95% intervals over seeds, and paired differences to a baseline.

Intervals are Student-t intervals, ``mean +- t(0.975, n-1) * sd / sqrt(n)``: with the 3-5 seeds a
CPU reproduction affords, a normal interval would be far too narrow. With one seed there is no
interval (``half`` is NaN) and reports say so instead of printing a fake one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# two-sided 95% quantiles of Student's t, t(0.975, df) for df = 1..30 (standard tables)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """t(0.975, df); the normal 1.96 beyond the table (df > 30 changes it by < 2%)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass(frozen=True)
class Interval:
    mean: float
    half: float  # half-width of the 95% interval; NaN with fewer than two values
    n: int

    def __str__(self) -> str:
        return fmt(self)


def mean_ci(values: Sequence[float]) -> Interval:
    """Mean and 95% t-interval of ``values`` (NaNs are an error: a run that logged none is a
    missing run, not a zero)."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("no values")
    if any(math.isnan(x) for x in xs):
        raise ValueError(f"NaN among {xs}")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Interval(mean, float("nan"), n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return Interval(mean, t975(n - 1) * sd / math.sqrt(n), n)


def paired_diff_ci(values: dict[int, float], baseline: dict[int, float]) -> Interval:
    """Mean and 95% interval of ``values[s] - baseline[s]`` over the seeds both have (the
    same seed means the same SFT start, prompts and sampling seeds, so pairing removes their
    shared variance)."""
    seeds = sorted(set(values) & set(baseline))
    if not seeds:
        raise ValueError("no seed in common with the baseline")
    return mean_ci([values[s] - baseline[s] for s in seeds])


def fmt(iv: Interval, scale: float = 100.0, digits: int = 1) -> str:
    """``45.3 ± 4.1`` (x ``scale``; percentages by default), or ``45.3 (1 seed)``."""
    m = f"{iv.mean * scale:.{digits}f}"
    if math.isnan(iv.half):
        return f"{m} (1 seed)"
    return f"{m} ± {iv.half * scale:.{digits}f}"
