"""The statistics of the paired-seed report: a 95% t-interval on paired differences.

Kept free of scipy (not a dependency of the package): Student's t distribution with an
integer number of degrees of freedom has a closed-form CDF (Abramowitz & Stegun 26.7.3-4),
and its quantile is found by bisection on that CDF.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

LEVEL = 0.95  # two-sided confidence level of every interval in the report


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` (integer >= 1) degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # odd: 2/pi [theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)]
        term, acc = c, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            acc += term
            term *= c * c * (2 * k) / (2 * k + 1)
        within = 2 / math.pi * (theta + s * acc)
    else:  # even: sin [1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...]
        term, acc = 1.0, 0.0
        for k in range(1, df // 2 + 1):
            acc += term
            term *= c * c * (2 * k - 1) / (2 * k)
        within = s * acc
    return 0.5 + math.copysign(within / 2, t)


def t_quantile(p: float, df: int) -> float:
    """The `p`-quantile of Student's t (bisection on `t_cdf`, to 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Interval:
    """Mean of paired differences and its two-sided t-interval (None below 2 values)."""
    n: int
    mean: float
    low: Optional[float]
    high: Optional[float]
    floored: bool = False  # s was raised to the measurement-noise floor (t_interval)

    def excludes_zero(self) -> bool:
        return self.low is not None and (self.low > 0 or self.high < 0)


def t_interval(values: Sequence[float], level: float = LEVEL, floor: float = 0.0) -> Optional[Interval]:
    """mean +- t_{(1+level)/2, n-1} * max(s, floor) / sqrt(n), s the sample standard deviation
    (n - 1).

    Across seeds of paired differences: the seeds are the independent units; with 3 seeds the
    t quantile is 4.30, so the interval is wide by construction. floor: the measurement noise
    of one value (a per-seed difference holds its runs' within-run noise, so the spread of
    such values cannot truly be smaller); with 2 or 3 seeds an s far below it is luck (two
    differences that happen to agree), and raising s to it keeps such luck from reading as
    a finding. 0: the plain t-interval."""
    vals = [float(v) for v in values]
    if not vals:
        return None
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return Interval(len(vals), mean, None, None)
    s = statistics.stdev(vals)
    floored = floor > s
    half = t_quantile((1 + level) / 2, len(vals) - 1) * max(s, floor) / math.sqrt(len(vals))
    return Interval(len(vals), mean, mean - half, mean + half, floored)


def standard_error(values: Sequence[float]) -> Optional[float]:
    """std (n - 1) / sqrt(n): the noise of a mean of `values` were they independent."""
    vals = [float(v) for v in values]
    return statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) >= 2 else None
