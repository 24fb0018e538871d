"""upper_rule "host" (the L-only arm, [ours]): H stays the host's 1 + eps_high on every step,
before and across calibrations, while L is calibrated exactly as under the default rule; the
negative-side guards, widen-only and log smoothing of L behave as documented. (The rule also
runs through the sort-based reference sweep of test_upper_rules.py.)"""
import math

import numpy as np
import pytest

from megatron_calibclip.calibration import CalibratedClipper, CalibrationConfig, compute_calibrated_bounds
from megatron_calibclip.config import ConfigError, from_dict
from tests.calibration.data import make_batch, step_tensors, step_with_clipped

EPS_LOW = 0.2


@pytest.mark.parametrize("eps_high", [0.2, 0.28])
def test_h_stays_the_hosts_bound_and_l_is_the_calibrated_one(eps_high):
    host = CalibratedClipper(CalibrationConfig(period=1, upper_rule="host"), eps_low=EPS_LOW, eps_high=eps_high)
    scaled = CalibratedClipper(CalibrationConfig(period=1), eps_low=EPS_LOW, eps_high=eps_high)
    assert host.begin_step(0) == (0.6, 1.0 + eps_high)  # initial_upper (1.8) is not read
    uppers, lowers = [], []
    for step in range(4):
        batch = step_tensors(make_batch("realistic", 4000, seed=step))
        host.begin_step(step)
        scaled.begin_step(step)
        res, ref = host.calibrate(*batch, step=step), scaled.calibrate(*batch, step=step)
        assert res.ok and ref.ok and res.upper_rule == "host"
        assert res.log_lower == ref.log_lower  # the same L*: H's rule does not touch it
        assert res.log_upper == math.log1p(eps_high) and ref.upper > 1.0 + eps_high  # log_scale widens H
        lowers.append(res.lower)
        uppers.append(host.next_bounds[1])
        assert host.next_bounds[0] == scaled.next_bounds[0]  # L smoothed alike (log-space EMA)
    assert uppers == [1.0 + eps_high] * 4  # exactly, as fixed clipping has it
    # L: the first calibration sets it, later ones are averaged in log space (beta 0.5)
    expected = lowers[0]
    for target in lowers[1:]:
        expected = math.exp(0.5 * math.log(expected) + 0.5 * math.log(target))
    assert host.next_bounds[0] == pytest.approx(expected, rel=1e-12) and expected < 1.0 - EPS_LOW
    assert host.metrics()["calib/upper_target"] == 1.0 + eps_high


def test_guards_fall_back_on_the_negative_side_only_and_keep_h():
    clipper = CalibratedClipper(CalibrationConfig(period=1, upper_rule="host", min_clipped_tokens=3),
                                eps_low=EPS_LOW, eps_high=0.28)
    scarce = clipper.calibrate(*step_tensors(step_with_clipped(2, seed=1)), step=0)
    assert scarce.reason_code == "too_few_clipped_negative" and clipper.next_bounds == (0.6, 1.28)
    empty = clipper.calibrate(*step_tensors(step_with_clipped(-1, seed=2)), step=1)
    assert empty.reason_code == "no_negative_tokens" and clipper.next_bounds == (0.6, 1.28)



@pytest.mark.parametrize("rule", ["host", "log_scale"])
def test_a_step_without_positive_tokens_calibrates_l(rule):
    # the closed-form rules read no A > 0 token (the tail rules fall back here); this used to
    # divide by |P| = 0 for the FP8 clip fraction at H
    only_negative = step_with_clipped(5, seed=3)
    only_negative["adv"] = -np.abs(only_negative["adv"])
    res = compute_calibrated_bounds(*step_tensors(only_negative), EPS_LOW, 0.28, upper_rule=rule,
                                    min_clipped_tokens=3)
    assert res.ok and res.n_pos == 0 and res.pos_clip_frac_fp8_upper is None
    assert res.n_neg_clipped_shadow == 5 and res.lower < 0.8
    tail = compute_calibrated_bounds(*step_tensors(only_negative), EPS_LOW, 0.28, upper_rule="quantile",
                                     min_clipped_tokens=3)
    assert tail.reason_code == "no_positive_tokens"


def test_widen_only_caps_l_and_the_fp8_clip_fraction_at_h_is_exact():
    batch = make_batch("realistic", 6000, seed=11)
    batch["lr8"] = batch["lr16"] * 0.3  # FP8 ratios narrower than the shadow's: L* above 0.8
    tensors = step_tensors(batch)
    widened = compute_calibrated_bounds(*tensors, EPS_LOW, 0.2, upper_rule="host", min_clipped_tokens=1)
    assert widened.ok and widened.log_lower_raw > math.log(0.8)
    assert widened.lower == pytest.approx(0.8, rel=1e-12) and widened.upper == pytest.approx(1.2, rel=1e-15)
    free = compute_calibrated_bounds(*tensors, EPS_LOW, 0.2, upper_rule="host", min_clipped_tokens=1,
                                     widen_only=False)
    assert free.ok and free.lower > 0.8 and free.log_upper == math.log1p(0.2)  # L tightens, H stays
    valid = batch["mask"] & np.isfinite(batch["lr8"]) & np.isfinite(batch["lr16"]) & np.isfinite(batch["adv"])
    pos = valid & (batch["adv"] > 0)
    fp8_above = int((batch["lr8"][pos].astype(np.float64) > math.log1p(0.2)).sum())
    assert widened.pos_clip_frac_fp8_upper == fp8_above / int(pos.sum())


def test_the_rule_is_a_config_value_like_the_others():
    assert from_dict(CalibrationConfig, {"upper_rule": "host"}).upper_rule == "host"
    with pytest.raises(ConfigError, match=r"upper_rule: 'l_only' is not one of .*'host'"):
        from_dict(CalibrationConfig, {"upper_rule": "l_only"})
