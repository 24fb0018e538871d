"""The t-interval of the paired-seed report against an independent computation: the t
quantile from a numeric integral of Student's density, the interval from `statistics`."""
import math
import statistics

import numpy as np
import pytest

from megatron_calibclip.experiment.report_stats import standard_error, t_cdf, t_interval, t_quantile


def t_975(df: int) -> float:
    """The 0.975 quantile of Student's t by integrating its density on a fine grid."""
    x = np.linspace(0.0, 80.0, 800_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    mass = np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))])
    return float(np.interp(0.475, mass, x))


def hand_interval(values, floor=0.0):
    """(mean, low, high) of the 95% t-interval, computed without the code under test; s no
    smaller than `floor`."""
    m = statistics.fmean(values)
    half = t_975(len(values) - 1) * max(statistics.stdev(values), floor) / math.sqrt(len(values))
    return m, m - half, m + half


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 30])
def test_t_quantile_matches_the_integrated_density(df):
    assert t_quantile(0.975, df) == pytest.approx(t_975(df), rel=1e-5)
    assert t_cdf(-1.3, df) == pytest.approx(1 - t_cdf(1.3, df), abs=1e-12)
    assert t_quantile(0.025, df) == pytest.approx(-t_quantile(0.975, df))


def test_t_interval_is_the_hand_computed_one():
    vals = [0.12, 0.31, 0.18]
    iv = t_interval(vals)
    m, lo, hi = hand_interval(vals)
    assert (iv.n, iv.mean, iv.low, iv.high) == (3, pytest.approx(m), pytest.approx(lo, rel=1e-5),
                                                pytest.approx(hi, rel=1e-5))
    one = t_interval([0.4])
    assert (one.mean, one.low, one.high, one.excludes_zero()) == (0.4, None, None, False)
    assert t_interval([]) is None


def test_two_values_that_agree_by_luck_get_the_noise_floor():
    """+0.011 and +0.010 (s 0.0007) from runs whose values each carry 0.025 of noise: the plain
    interval excludes 0, the floored one does not, and says it was floored."""
    plain, floored = t_interval([0.011, 0.010]), t_interval([0.011, 0.010], floor=0.025)
    assert plain.excludes_zero() and not plain.floored
    m, lo, hi = hand_interval([0.011, 0.010], floor=0.025)
    assert (floored.low, floored.high) == (pytest.approx(lo, rel=1e-5), pytest.approx(hi, rel=1e-5))
    assert floored.floored and not floored.excludes_zero() and lo < 0 < hi
    wide = t_interval([0.3, -0.2, 0.1], floor=0.025)  # s 0.26 above the floor: the plain interval
    assert not wide.floored and (wide.low, wide.high) == (t_interval([0.3, -0.2, 0.1]).low,
                                                          t_interval([0.3, -0.2, 0.1]).high)


def test_standard_error_is_std_over_sqrt_n():
    vals = [0.2, 0.9, 0.4, 0.6]
    assert standard_error(vals) == pytest.approx(statistics.stdev(vals) / 2)
    assert standard_error([0.5]) is None
