"""pool_calibrations: a calibration solved on the merged histograms of the last m calibration
steps. Checked against exact sorting of the union of those steps' tokens (tests/calibration/
reference.py, no histogram code), on 1, 2 and 4 gloo ranks, through checkpoint state, and by
what it is for: a small-batch L* with far less spread than one step's (retries: test_retry.py)."""
import json
import math

import numpy as np
import pytest

from megatron_calibclip.calibration import CalibratedClipper, CalibrationConfig
from tests.calibration.data import KEYS, small_step, step_tensors, union
from tests.calibration.distutil import group_of
from tests.calibration.reference import exact_lower, snapped_ok

EPS_LOW, EPS_HIGH = 0.2, 0.28


def _clipper(pool: int, **kw) -> CalibratedClipper:
    cfg = CalibrationConfig(period=1, pool_calibrations=pool, min_clipped_tokens=kw.pop("min_clipped_tokens", 1),
                            widen_only=False, **kw)
    return CalibratedClipper(cfg, eps_low=EPS_LOW, eps_high=EPS_HIGH)


def test_a_pooled_calibration_reads_the_union_of_the_last_m_steps():
    steps = [small_step(seed) for seed in range(5)]
    clipper, cfg = _clipper(3), CalibrationConfig()
    width = (cfg.log_ratio_max - cfg.log_ratio_min) / cfg.bins
    for i, step in enumerate(steps):
        res = clipper.calibrate(*step_tensors(step), step=i)
        window = steps[max(0, i - 2):i + 1]
        exact = exact_lower(*(union(window)[k] for k in KEYS), EPS_LOW, EPS_HIGH)
        assert res.ok, res.reason
        assert res.pooled_calibrations == len(window)
        assert (res.n_neg, res.n_pos, res.n_neg_clipped_shadow) == (exact.n_neg, exact.n_pos, exact.k)
        assert res.alpha == pytest.approx(exact.alpha, rel=1e-12)
        if len(window) > 1:  # pooled: one pass, L* is the exact order statistic rounded up to the grid
            assert not res.refined and res.resolution == pytest.approx(width)
            assert snapped_ok(res.log_lower, exact.log_lower, cfg.log_ratio_min, cfg.log_ratio_max, width)
        else:  # the first step alone: the refined (unpooled) solve
            assert res.refined and abs(res.log_lower - exact.log_lower) <= res.resolution * (1 + 1e-9)
    assert clipper.metrics()["calib/pooled_calibrations"] == 3.0


def test_a_pool_of_one_is_the_unpooled_calibration():
    step = small_step(7)
    pooled, plain = _clipper(1), _clipper(1)
    acc = plain.new_accumulator()
    acc.add(*step_tensors(step))
    assert pooled.calibrate(*step_tensors(step), step=0) == acc.compute()
    assert pooled.state_dict()["pool"] == []


def test_pooling_lets_the_count_guard_pass_at_small_batch():
    steps = [small_step(seed) for seed in (1, 2, 3)]
    ks = [exact_lower(*(s[k] for k in KEYS), EPS_LOW, EPS_HIGH).k for s in steps]
    guard = sum(ks)  # each step alone has fewer shadow-clipped tokens than this, the three together have it
    assert max(ks) < guard
    alone, pooled = _clipper(1, min_clipped_tokens=guard), _clipper(3, min_clipped_tokens=guard)
    for i, step in enumerate(steps):
        single = alone.calibrate(*step_tensors(step), step=i)
        together = pooled.calibrate(*step_tensors(step), step=i)
        assert single.reason_code == "too_few_clipped_negative"
        assert together.ok == (i == 2), together.reason
    assert pooled.next_bounds[0] == pytest.approx(together.lower)


def test_a_step_with_a_nonfinite_token_falls_back_and_is_not_pooled():
    good, bad, last = small_step(1), small_step(2), small_step(3)
    bad["lr8"][np.flatnonzero(bad["mask"])[0]] = np.nan
    clipper = _clipper(3)
    assert clipper.calibrate(*step_tensors(good), step=0).ok
    assert clipper.calibrate(*step_tensors(bad), step=1).reason_code == "nonfinite_ratio"
    res = clipper.calibrate(*step_tensors(last), step=2)
    assert res.ok and res.pooled_calibrations == 2  # `bad` was left out of the pool
    assert res.n_neg == exact_lower(*(union([good, last])[k] for k in KEYS), EPS_LOW, EPS_HIGH).n_neg


def test_a_step_without_negative_tokens_takes_no_slot_in_the_pool():
    first, last = small_step(1), small_step(3)
    empty = small_step(2)
    empty["adv"] = np.abs(empty["adv"])  # every group right (or wrong) alike: no A < 0 token
    clipper = _clipper(2)
    clipper.calibrate(*step_tensors(first), step=0)
    # its own guard decides (re-solving the pool alone would feed the EMA the same target twice)
    alone = clipper.calibrate(*step_tensors(empty), step=1)
    assert alone.reason_code == "no_negative_tokens" and alone.pooled_calibrations == 1
    res = clipper.calibrate(*step_tensors(last), step=2)
    assert res.pooled_calibrations == 2  # `first` is still in the pool of 2
    assert res.n_neg == exact_lower(*(union([first, last])[k] for k in KEYS), EPS_LOW, EPS_HIGH).n_neg


def test_the_pool_survives_a_checkpoint_as_plain_values():
    steps = [small_step(seed) for seed in (4, 5, 6)]
    a = _clipper(3)
    for i, step in enumerate(steps[:2]):
        a.calibrate(*step_tensors(step), step=i)
    state = json.loads(json.dumps(a.state_dict()))  # plain values: JSON round trip
    b = _clipper(3)
    b.load_state_dict(state)
    assert a.calibrate(*step_tensors(steps[2]), step=2) == b.calibrate(*step_tensors(steps[2]), step=2)
    assert a.state_dict() == b.state_dict()
    # a state saved before pooling existed (no "pool") loads with an empty pool
    old = {k: v for k, v in state.items() if k != "pool"}
    c = _clipper(3)
    c.load_state_dict(old)
    assert c.calibrate(*step_tensors(steps[2]), step=2).pooled_calibrations == 1
    # a pool saved on another histogram grid is not pooled with this one's
    e = _clipper(3, bins=8192)
    e.load_state_dict(state)
    assert e.state_dict()["pool"] == [] and e.calibrate(*step_tensors(steps[2]), step=2).pooled_calibrations == 1
    # a smaller pool keeps the newest entries only
    d = _clipper(2)
    d.load_state_dict(state)
    assert len(d.state_dict()["pool"]) == 1 and d.state_dict()["pool"][0] == state["pool"][-1]


def test_pool_calibrations_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pool_calibrations"):
            CalibrationConfig(pool_calibrations=bad)


def _rank_pooled(rank, world_size, steps, owners):
    """Pooled calibrations of the same steps over DP groups of 1, 2 and 4 ranks."""
    out = []
    for size in (1, 2, 4):
        group, index = group_of(size)
        clipper = _clipper(3)
        results = [clipper.calibrate(*step_tensors(step, owner[size] == index), step=i, group=group)
                   for i, (step, owner) in enumerate(zip(steps, owners))]
        out.append([dict(r.__dict__) for r in results])
    return out


@pytest.mark.dist
def test_pooled_bounds_are_identical_on_1_2_and_4_ranks(dist_pool):
    steps = [small_step(seed, n=800) for seed in (8, 9, 10, 11)]
    rng = np.random.default_rng(0)
    owners = [{size: rng.integers(0, size, len(s["mask"])) for size in (1, 2, 4)} for s in steps]
    per_rank = dist_pool(4).run(_rank_pooled, steps, owners)
    first = per_rank[0][0]
    for rank_results in per_rank:
        for by_size in rank_results:
            for got, want in zip(by_size, first):
                for key in ("log_lower", "log_upper", "n_neg", "n_pos", "n_neg_clipped_shadow",
                            "pooled_calibrations", "reason"):
                    assert got[key] == want[key], (key, got[key], want[key])
    assert [r["pooled_calibrations"] for r in first] == [1, 2, 3, 3]


def test_pooling_shrinks_the_spread_of_a_small_batch_lower_bound():
    """The reason for the option: over 100 windows of small steps, the error of log L against
    the population's quantile (2M tokens, exact) is much smaller pooled over 4 steps than from
    one, and no pooled calibration falls back (one step alone: alpha_zero when the shadow clips
    no token). Measured over 200 windows: RMSE 0.082 / 0.066 / 0.042 / 0.026 in log r for
    m = 1 / 2 / 4 / 8, fallbacks 17 / 1 / 0 / 0."""
    big = small_step(10_000, n=2_000_000)
    population = exact_lower(*(big[k] for k in KEYS), EPS_LOW, EPS_HIGH).log_lower
    errors: dict[int, list[float]] = {1: [], 4: []}
    fallbacks = {1: 0, 4: 0}
    for m in errors:
        clipper = _clipper(m)
        for i in range(100 + 3):
            res = clipper.calibrate(*step_tensors(small_step(100 + i)), step=i)
            if i < 3:  # every window full from here on
                continue
            if res.ok:
                errors[m].append(res.log_lower - population)
            else:
                fallbacks[m] += 1
    rmse = {m: math.sqrt(np.mean(np.square(e))) for m, e in errors.items()}
    assert fallbacks[4] == 0 and fallbacks[1] > 0, fallbacks
    assert rmse[4] < 0.7 * rmse[1], rmse
