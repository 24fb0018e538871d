"""CalibratedClipper: timing, EMA, clamps, guard fallbacks, state_dict round trip; config."""
import dataclasses
import inspect
import json
import math

import numpy as np
import pytest
import torch

from megatron_calibclip.calibration import (
    CalibratedClipper,
    CalibrationConfig,
    compute_calibrated_bounds,
)
from megatron_calibclip.config import ConfigError, from_dict
from tests.calibration.checks import fake_result
from tests.calibration.data import make_batch


def _tensors(batch):
    return [torch.from_numpy(np.ascontiguousarray(batch[k])) for k in ("lr8", "lr16", "adv", "mask")]


def test_period_and_timing_bounds_take_effect_from_the_next_step():
    clipper = CalibratedClipper(CalibrationConfig(period=3), eps_low=0.2, eps_high=0.28)
    assert [s for s in range(10) if clipper.is_calibration_step(s)] == [0, 3, 6, 9]
    assert clipper.begin_step(0) == (0.6, 1.8)
    assert clipper.update(fake_result(0.7, 1.4), step=0)
    assert clipper.bounds == (0.6, 1.8)  # the calibration step keeps the bounds it began with
    assert clipper.next_bounds == (0.7, 1.4)
    assert clipper.begin_step(0) == (0.6, 1.8)  # re-entering step 0 does not promote
    assert clipper.begin_step(1) == (0.7, 1.4)  # first calibration sets the bounds directly
    assert clipper.begin_step(2) == (0.7, 1.4)


@pytest.mark.parametrize("code", ["no_negative_tokens", "alpha_zero", "too_few_clipped_negative"])
def test_retry_on_scarce_data_calibrates_again_next_step_until_one_runs(code):
    def schedule(retry):
        clipper = CalibratedClipper(CalibrationConfig(period=5, retry_on_scarce_data=retry),
                                    eps_low=0.2, eps_high=0.28)
        steps = []
        for step in range(12):
            clipper.begin_step(step)
            if not clipper.is_calibration_step(step):
                continue
            steps.append(step)
            if step in (0, 1, 5):  # no data on these
                clipper.update(fake_result(None, None, reason=f"{code}: nothing to read"), step)
            elif step == 2:
                continue  # step 2 skipped by the trainer (no mixed group): the retry stays due
            else:
                assert clipper.update(fake_result(0.7, 1.4), step)
        return steps, clipper

    assert schedule(False)[0] == [0, 5, 10]  # the paper's schedule: data-less calibrations are lost
    steps, clipper = schedule(True)
    assert steps == [0, 1, 2, 3, 5, 6, 10]
    state = json.loads(json.dumps(clipper.state_dict()))
    assert state["retry_from"] is None
    # a retry pending at a checkpoint survives it
    pending = CalibratedClipper(CalibrationConfig(period=5, retry_on_scarce_data=True), eps_low=0.2, eps_high=0.28)
    pending.update(fake_result(None, None, reason=f"{code}: nothing"), step=5)
    restored = CalibratedClipper(CalibrationConfig(period=5, retry_on_scarce_data=True), eps_low=0.2, eps_high=0.28)
    restored.load_state_dict(json.loads(json.dumps(pending.state_dict())))
    assert restored.is_calibration_step(6) and not restored.is_calibration_step(4)


def test_other_fallbacks_do_not_retry():
    clipper = CalibratedClipper(CalibrationConfig(period=5, retry_on_scarce_data=True), eps_low=0.2, eps_high=0.28)
    clipper.update(fake_result(None, None, reason="upper_out_of_range: H* 30 is outside"), step=0)
    assert not clipper.is_calibration_step(1)


def test_ema_smoothing_linear_option_and_clamps():
    cfg = CalibrationConfig(period=1, ema_beta=0.75, smoothing="linear")
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    clipper.begin_step(0)
    clipper.update(fake_result(0.8, 1.2), step=0)
    assert clipper.begin_step(1) == (0.8, 1.2)
    clipper.update(fake_result(0.4, 2.0), step=1)
    lower, upper = clipper.begin_step(2)
    assert lower == pytest.approx(0.75 * 0.8 + 0.25 * 0.4, rel=1e-15)
    assert upper == pytest.approx(0.75 * 1.2 + 0.25 * 2.0, rel=1e-15)
    # the clamp to [0.05, 0.999] x [1.001, 20] is a safety net for finite bounds only
    fresh = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    fresh.update(fake_result(math.exp(-4.0), 25.0), step=0)
    assert fresh.begin_step(1) == (0.05, 20.0)
    fresh.update(fake_result(0.99999, 1.0000001), step=1)
    assert fresh.begin_step(2) == pytest.approx((0.75 * 0.05 + 0.25 * 0.999, 0.75 * 20.0 + 0.25 * 1.001))
    assert fresh.metrics()["calib/lower_target"] == 0.999 and fresh.metrics()["calib/upper_target"] == 1.001


def test_default_smoothing_is_in_log_space_and_an_infinite_bound_is_a_fallback():
    clipper = CalibratedClipper(CalibrationConfig(period=1, ema_beta=0.5), eps_low=0.2, eps_high=0.2)
    clipper.update(fake_result(0.5, 2.0), step=0)
    clipper.update(fake_result(0.8, 8.0), step=1)
    lower, upper = clipper.begin_step(2)
    assert lower == pytest.approx(math.sqrt(0.5 * 0.8), rel=1e-14)  # geometric, not (0.5 + 0.8) / 2
    assert upper == pytest.approx(4.0, rel=1e-14)  # sqrt(2 * 8); the linear mean would be 5
    assert not clipper.update(fake_result(0.7, math.inf), step=2)  # never turned into the clamp (20)
    assert clipper.last_reason.startswith("nonfinite_bound") and clipper.next_bounds == (lower, upper)
    assert clipper.metrics()["calib/fallback_reason"] == clipper.last_reason


def _few_clipped(b):
    """The shadow clips exactly 5 negative tokens (fewer than min_clipped_tokens = 20)."""
    b["lr16"] = np.zeros_like(b["lr16"])
    neg = np.flatnonzero(b["mask"] & (b["adv"] < 0))
    b["lr16"][neg[:5]] = -1.0


@pytest.mark.parametrize(
    "make, code",
    [
        (lambda b: b.__setitem__("adv", np.abs(b["adv"])), "no_negative_tokens"),
        (lambda b: b.__setitem__("lr16", np.zeros_like(b["lr16"])), "alpha_zero"),
        (_few_clipped, "too_few_clipped_negative"),
        (lambda b: b["lr8"].__setitem__(int(np.flatnonzero(b["mask"])[3]), np.inf), "nonfinite_ratio"),
        (lambda b: b["adv"].__setitem__(int(np.flatnonzero(b["mask"])[3]), np.nan), "nonfinite_advantage"),
        (lambda b: b.__setitem__("lr8", b["lr8"] - 5.0), "lower_out_of_range"),
    ],
)
def test_guards_keep_previous_bounds_and_record_why(make, code):
    clipper = CalibratedClipper(CalibrationConfig(period=1), eps_low=0.2, eps_high=0.28)
    good = make_batch("realistic", 3000, 0)
    assert clipper.calibrate(*_tensors(good), step=0).ok
    before = clipper.begin_step(1)
    bad = make_batch("realistic", 3000, 1)
    make(bad)
    res = clipper.calibrate(*_tensors(bad), step=1)
    assert res.reason_code == code and res.lower is None
    assert clipper.begin_step(2) == before and clipper.next_bounds == before
    assert clipper.last_reason == res.reason
    m = clipper.metrics()
    assert m["calib/fallback"] == 1.0 and m["calib/fallbacks"] == 1.0 and m["calib/calibrations"] == 1.0
    assert m["calib/fallback_reason"] == res.reason and m["calib/upper_rule"] == "log_scale"
    # the next good calibration is smoothed (in log space) with the kept bounds (not "first" again)
    res2 = clipper.calibrate(*_tensors(good), step=2)
    expected = (math.sqrt(before[0] * res2.lower), math.sqrt(before[1] * res2.upper))
    assert clipper.begin_step(3) == pytest.approx(expected, rel=1e-14)
    assert clipper.last_reason is None and clipper.metrics()["calib/fallback"] == 0.0
    assert clipper.metrics()["calib/fallback_reason"] == ""


def test_state_dict_round_trip_continues_identically():
    cfg = CalibrationConfig(period=2, ema_beta=0.3, refine=True)
    a = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.28)
    batches = [make_batch("realistic", 2000, s) for s in range(3)]
    a.begin_step(0)
    a.calibrate(*_tensors(batches[0]), step=0)
    a.begin_step(1)
    a.begin_step(2)
    a.update(fake_result(None, None, reason="alpha_zero: test"), step=2)
    a.calibrate(*_tensors(batches[1]), step=2)  # pending at save time
    state = json.loads(json.dumps(a.state_dict()))  # plain values only
    b = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.28)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    assert b.bounds == a.bounds and b.next_bounds == a.next_bounds and b.metrics() == a.metrics()
    for c in (a, b):
        c.begin_step(3)
        c.begin_step(4)
        c.calibrate(*_tensors(batches[2]), step=4)
        c.begin_step(5)
    assert a.state_dict() == b.state_dict() and a.bounds == b.bounds
    with pytest.raises(ValueError, match="format"):
        b.load_state_dict({"lower": 0.5})


def test_clipper_accumulator_uses_its_config():
    cfg = CalibrationConfig(mass="tokens", bins=4096, log_ratio_min=-3.5, log_ratio_max=3.5, refine=True)
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.28)
    batch = make_batch("heavy", 5000, 4)
    acc = clipper.new_accumulator()
    half = len(batch["mask"]) // 2
    acc.add(*_tensors({k: v[:half] for k, v in batch.items()}))
    acc.add(*_tensors({k: v[half:] for k, v in batch.items()}))
    res = acc.compute()
    ref = compute_calibrated_bounds(*_tensors(batch), 0.2, 0.28, mass="tokens", bins=4096, log_ratio_min=-3.5,
                                    log_ratio_max=3.5, refine=True)
    assert res.ok
    assert res == ref and res.resolution == cfg.resolution == 7.0 / 4096 / 4096
    with pytest.raises(RuntimeError, match="already"):
        acc.compute()


def test_config_from_yaml_dict_validation_and_documentation():
    cfg = from_dict(CalibrationConfig, {"period": 10, "ema_beta": 0.0, "mass": "tokens", "refine": "true"})
    assert cfg.period == 10 and cfg.refine is True and cfg.mass == "tokens"
    bad = [({"mass": "count"}, "mass"), ({"shadow_precision": "fp8"}, "shadow_precision"),
           ({"lower_max": 1.0}, "lower_min/lower_max"), ({"initial_upper": 30.0}, "initial_upper"),
           ({"log_ratio_min": -2.0}, "log_ratio_min"), ({"period": 0}, "period"), ({"bins": "many"}, "bins"),
           ({"ema_beta": 1.0}, "ema_beta"), ({"typo": 1}, "unknown key"),
           ({"upper_rule": "spec"}, "upper_rule"), ({"smoothing": "geometric"}, "smoothing"),
           ({"min_clipped_tokens": 0}, "min_clipped_tokens"), ({"widen_only": "maybe"}, "widen_only")]
    for data, field in bad:
        with pytest.raises(ConfigError, match=field):
            from_dict(CalibrationConfig, data)
    # every field is documented by a comment right above its declaration
    lines = inspect.getsource(CalibrationConfig).splitlines()
    for f in dataclasses.fields(CalibrationConfig):
        i = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
        assert lines[i - 1].strip().startswith("#"), f.name
