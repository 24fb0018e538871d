"""retry_on_scarce_data, capped: retries stay inside the period of the calibration they repeat
(at most retry_steps, default K - 1, after each scheduled one), a pooled calibration reads one
step per period (its latest attempt with A < 0 tokens: what the schedule would have read), and
both survive a checkpoint. Pooled reads are checked against exact sorting of the union of the
steps the schedule would have read (tests/calibration/reference.py)."""
import json

import pytest

from megatron_calibclip.calibration import CalibratedClipper, CalibrationConfig
from megatron_calibclip.config import ConfigError
from tests.calibration.checks import fake_result
from tests.calibration.data import KEYS, step_tensors, step_with_clipped, union
from tests.calibration.reference import exact_lower

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _clipper(**kw) -> CalibratedClipper:
    cfg = CalibrationConfig(**{"period": 5, "retry_on_scarce_data": True, **kw})
    return CalibratedClipper(cfg, eps_low=EPS_LOW, eps_high=EPS_HIGH)


def _calibration_steps(clipper: CalibratedClipper, steps, fails=(), skipped=()) -> list[int]:
    """Steps that calibrate; a calibration on a step in `fails` falls back for lack of data,
    one in `skipped` is skipped by the trainer (no update), any other succeeds."""
    out = []
    for step in steps:
        clipper.begin_step(step)
        if not clipper.is_calibration_step(step):
            continue
        out.append(step)
        if step in skipped:
            continue
        reason = "too_few_clipped_negative: 1 of 90" if step in fails else None
        clipper.update(fake_result(None if reason else 0.7, None if reason else 1.4, reason=reason), step)
    return out


def test_retries_end_with_the_period_of_the_calibration_they_repeat():
    # step 0 falls back, the trainer skips steps 1-5 (no group with mixed rewards): the retry
    # lasts to the end of period 0-4, step 5 is the next scheduled one (skipped too), and the
    # retry of period 0 does not spill into period 5-9
    assert _calibration_steps(_clipper(), range(12), fails={0}, skipped={1, 2, 3, 4, 5}) == [0, 1, 2, 3, 4, 5, 10]
    assert _calibration_steps(_clipper(), range(12), fails={0, 1, 2, 3}, skipped={4, 5}) == [0, 1, 2, 3, 4, 5, 10]


def test_while_data_stay_scarce_each_period_retries_at_most_retry_steps_times():
    every = set(range(40))  # every calibration falls back
    steps = _calibration_steps(_clipper(), range(40), fails=every)
    assert steps == list(range(40))  # default K - 1: every step of each period
    capped = _calibration_steps(_clipper(retry_steps=2), range(40), fails=every)
    assert capped == [s for s in range(40) if s % 5 <= 2]  # the scheduled step + 2 retries
    assert _calibration_steps(_clipper(retry_on_scarce_data=False), range(40), fails=every) == [0, 5, 10, 15, 20, 25,
                                                                                               30, 35]
    # a success ends the retries of its period
    assert _calibration_steps(_clipper(), range(10), fails={0, 5, 6}) == [0, 1, 5, 6, 7]


def test_retry_steps_is_validated_against_the_period():
    assert CalibrationConfig(period=5, retry_on_scarce_data=True).max_retries == 4
    assert CalibrationConfig(period=5, retry_on_scarce_data=True, retry_steps=1).max_retries == 1
    assert CalibrationConfig(period=5, retry_steps=1).max_retries == 0  # no retries without the option
    for bad in (0, 5, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match=r"calibration\.retry_steps: .* integer in \[1, period - 1 = 4\]"):
            CalibrationConfig(period=5, retry_on_scarce_data=True, retry_steps=bad)


# shadow-clipped A < 0 tokens of each step's data (-1: no A < 0 token at all)
CLIPPED = {0: 1, 1: 2, 2: 3, 5: -1, 6: 1, 10: 1}
# what each calibration reads with pool_calibrations 3, min_clipped_tokens 3, K 5: one step per
# earlier period (its latest attempt with A < 0 tokens) and this step; a retry never pools with
# an earlier attempt of its own period (the schedule reads one step per period)
READS = {0: [0], 1: [1], 2: [2], 5: [5], 6: [2, 6], 10: [2, 6, 10]}
OUTCOME = {0: "too_few_clipped_negative", 1: "too_few_clipped_negative", 2: None, 5: "no_negative_tokens",
           6: None, 10: None}


def _run_pooled(clipper, data, steps, results):
    for step in steps:
        clipper.begin_step(step)
        if clipper.is_calibration_step(step):
            results[step] = clipper.calibrate(*step_tensors(data[step]), step=step)


def test_a_pooled_retry_reads_what_the_schedule_would_have_read():
    data = {step: step_with_clipped(k, seed=step) for step, k in CLIPPED.items()}
    clipper = _clipper(pool_calibrations=3, min_clipped_tokens=3)
    results = {}
    _run_pooled(clipper, data, range(11), results)
    assert sorted(results) == sorted(READS)
    for step, reads in READS.items():
        res = results[step]
        assert res.reason_code == OUTCOME[step], (step, res.reason)
        assert res.pooled_calibrations == len(reads), step
        exact = exact_lower(*(union([data[s] for s in reads])[k] for k in KEYS), EPS_LOW, EPS_HIGH)
        assert (res.n_neg, res.n_neg_clipped_shadow) == (exact.n_neg, exact.k), step
    # the pool holds one step per period: period 0's last attempt (step 2), period 1's (step 6), step 10
    assert [entry["period"] for entry in clipper.state_dict()["pool"]] == [1, 2]


def _plain(state: dict) -> str:
    return json.dumps(state, sort_keys=True)  # NaN metrics compare equal as text


def test_the_capped_retry_and_the_period_pool_survive_a_checkpoint():
    data = {step: step_with_clipped(k, seed=step) for step, k in CLIPPED.items()}
    straight, results = _clipper(pool_calibrations=3, min_clipped_tokens=3), {}
    _run_pooled(straight, data, range(11), results)
    first, resumed_results = _clipper(pool_calibrations=3, min_clipped_tokens=3), {}
    _run_pooled(first, data, range(6), resumed_results)  # saved after step 5: a retry pending
    state = json.loads(json.dumps(first.state_dict()))
    assert (state["retry_from"], state["retry_until"]) == (6, 10)
    resumed = _clipper(pool_calibrations=3, min_clipped_tokens=3)
    resumed.load_state_dict(state)
    assert _plain(resumed.state_dict()) == _plain(first.state_dict())
    _run_pooled(resumed, data, range(6, 11), resumed_results)
    assert resumed_results == results and _plain(resumed.state_dict()) == _plain(straight.state_dict())


def test_a_state_saved_before_the_cap_loads_with_the_retry_ending_with_its_period():
    clipper = _clipper(pool_calibrations=3, min_clipped_tokens=3)
    data = {step: step_with_clipped(k, seed=step) for step, k in CLIPPED.items()}
    _run_pooled(clipper, data, range(6), {})
    old = json.loads(json.dumps(clipper.state_dict()))
    del old["retry_until"]
    for entry in old["pool"]:
        del entry["period"]
    restored = _clipper(pool_calibrations=3, min_clipped_tokens=3)
    restored.load_state_dict(old)
    assert [s for s in range(6, 16) if restored.is_calibration_step(s)] == [6, 7, 8, 9, 10, 15]
    # the saved pool entry counts as an earlier period: step 6 pools with it
    res = restored.calibrate(*step_tensors(data[6]), step=6)
    assert res.pooled_calibrations == 2
