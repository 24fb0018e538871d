"""The statistics of the limits section (experiment/report_limits.py) against published values,
and its phantom share against a hand count."""
from __future__ import annotations

import pytest

from megatron_calibclip.experiment.report_limits import (chi2_quantile, fisher_two_sided,
                                                         phantom_share, seeds_needed)


@pytest.mark.parametrize("p, df, expected", [  # chi-square tables (e.g. NIST/SEMATECH 1.3.6.7.4)
    (0.025, 1, 0.000982), (0.975, 1, 5.024), (0.025, 2, 0.0506), (0.975, 2, 7.378),
    (0.025, 3, 0.216), (0.975, 3, 9.348), (0.975, 10, 20.483)])
def test_chi2_quantiles_match_the_tables(p, df, expected):
    assert chi2_quantile(p, df) == pytest.approx(expected, rel=2e-3)


@pytest.mark.parametrize("effect, expected", [(1.0, 10), (0.5, 34), (0.8, 15)])
def test_seeds_needed_matches_the_paired_t_test_tables(effect, expected):
    """Cohen's d = delta / sd; the sample sizes of a two-sided one-sample (paired) t-test with
    80% power at 5% (Cohen 1988; G*Power gives 10, 34 and 15)."""
    assert seeds_needed(1.0, effect) == expected


def test_fisher_exact_two_sided():
    assert fisher_two_sided(3, 3, 0, 3) == pytest.approx(0.1)  # 2 / C(6, 3)
    assert fisher_two_sided(2, 3, 0, 3) == pytest.approx(0.4)
    assert fisher_two_sided(1, 2, 1, 2) == pytest.approx(1.0)


def test_phantom_share_is_the_ratio_of_the_window_sums():
    rows = [{"step": 0, "loss/clipfrac_lower": 0.2, "loss/phantom_clipfrac": 0.1},
            {"step": 1, "loss/clipfrac_lower": 0.0, "loss/phantom_clipfrac": 0.0},
            {"step": 2, "loss/clipfrac_lower": 0.4, "loss/phantom_clipfrac": 0.4},
            {"step": 3}]  # a step without the metrics (no A<0 token) is skipped
    assert phantom_share(rows, 0, 2) == pytest.approx(0.5)
    assert phantom_share(rows, 0, None) == pytest.approx(0.5 / 0.6)
    assert phantom_share(rows, 1, 2) is None  # nothing clipped: no share
