"""Calibrated Clipping through the real trainer (2 gloo ranks, DP=2): calibrations succeed,
their bounds match a sort-based reference on the very tokens the trainer fed the estimator,
the loss of the next step runs with the new bounds, and a resume in the middle of the
log-space smoothing continues exactly as an uninterrupted run."""
from __future__ import annotations

import glob
import math

import numpy as np
import pytest
import torch

from tests.calibration.reference import exact_bounds
from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

# enough movement per step that BF16 clips negative tokens: 4 mini-batch updates at a high
# learning rate; the tiny batches need a guard of 4 tokens (the default, 20, is for real runs)
CALIB = {"period": 1, "ema_beta": 0.5, "min_clipped_tokens": 4, "widen_only": False}
CFG = merge(TINY_TRAIN, {
    "parallel": {"tp": 1},
    "run": {"tensorboard": False, "plot": False, "steps": 4, "seed": 3},
    "warmup": {"steps": 40, "prompts_per_step": 16},
    "algorithm": {"group_size": 8, "prompts_per_step": 8, "mini_batches": 4, "micro_batch_size": 8},
    "optimizer": {"lr": 5e-3},
    "clipping": {"calibration": CALIB},
})


def _body(rank, world_size, cfg_dict):
    """Train, capturing the clip bounds each policy_loss call received, per step."""
    import megatron_calibclip.trainer.loop as loop
    import megatron_calibclip.trainer.step as step_mod
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train

    seen: dict[int, set] = {}
    current = [None]
    real_loss, real_step = step_mod.policy_loss, loop.train_step

    def loss_spy(*args, clip_low, clip_high, **kwargs):
        seen.setdefault(current[0], set()).add((clip_low, clip_high))
        return real_loss(*args, clip_low=clip_low, clip_high=clip_high, **kwargs)

    def step_spy(c, step, **kw):
        current[0] = step
        return real_step(c, step, **kw)

    step_mod.policy_loss, loop.train_step = loss_spy, step_spy
    try:
        records = train(from_dict(TrainConfig, cfg_dict))["records"]
    finally:
        step_mod.policy_loss, loop.train_step = real_loss, real_step
    return records, {k: sorted(v) for k, v in seen.items()}


def _cfg(tmp_path, name, **run):
    return merge(CFG, {"run": {"name": name, "output_dir": str(tmp_path), **run},
                       "clipping": {"calibration": {"record_dir": str(tmp_path / name / "calib")}}})


def _recorded(folder, step):
    """The trainer's calibration inputs of `step`, concatenated over the DP ranks."""
    parts = {k: [] for k in ("logratio_fp8", "logratio_shadow", "advantages", "mask")}
    files = sorted(glob.glob(f"{folder}/step{step:06d}_rank*.pt"))
    assert len(files) == 2, files  # one per data-parallel rank
    for path in files:
        for mb in torch.load(path, weights_only=False)["minibatches"]:
            for k in parts:
                parts[k].append(mb[k].double().numpy() if k != "mask" else mb[k].numpy())
    return {k: np.concatenate(v) for k, v in parts.items()}


def _numbers(record):
    """Everything but timings; NaN (an undefined rate) compares equal to NaN."""
    return {k: "nan" if isinstance(v, float) and v != v else v
            for k, v in record.items() if not k.startswith("time/")}


def test_calibrations_succeed_move_bounds_and_reach_the_loss(dist_pool, tmp_path):
    cfg = _cfg(tmp_path, "calibrated")
    results = dist_pool(2).run(_body, cfg, timeout=600)
    (records, seen), (records1, seen1) = results
    assert [_numbers(r) for r in records] == [_numbers(r) for r in records1] and seen == seen1, \
        "every rank must see the same bounds"
    initial = (cfg["clipping"]["calibration"].get("initial_lower", 0.6),
               cfg["clipping"]["calibration"].get("initial_upper", 1.8))
    assert seen[0] == [initial]
    for r in records:
        s = r["step"]
        assert r["calib/ran"] == 1.0
        assert r["calib/fallback"] == 0.0, (s, r["calib/fallback_reason"])
        assert r["calib/fallback_reason"] == "" and r["calib/upper_rule"] == "log_scale"
        assert r["calib/n_neg_clipped_shadow"] >= 1 and math.isfinite(r["calib/upper"])
        # the bounds the loss used are those in force, and those are what the last
        # calibration set for this step
        assert seen[s] == [(r["clip/lower"], r["clip/upper"])]
        if s > 0:
            prev = records[s - 1]
            assert (r["clip/lower"], r["clip/upper"]) == (prev["clip/next_lower"], prev["clip/next_upper"])
        # the estimator on the tokens the trainer recorded, against a sort-based reference
        data = _recorded(tmp_path / "calibrated" / "calib", s)
        ref = exact_bounds(data["logratio_fp8"], data["logratio_shadow"], data["advantages"],
                           data["mask"], 0.2, 0.2, rule="log_scale", min_clipped=4, widen_only=False)
        assert ref.reason is None
        assert r["calib/n_neg"] == int(((data["advantages"] < 0) & data["mask"]).sum())
        assert r["neg_tokens"] == r["calib/n_neg"]  # the loss's denominator of its A<0 rates
        # L* rounded up to the estimator's grid (exp then log in the record: 1e-12 slack)
        gap = math.log(r["calib/lower_raw"]) - ref.log_lower_raw
        assert -1e-12 <= gap <= r["calib/resolution"] + 1e-9
    # [L, H] moved away from the initial bounds and kept moving with the smoothing
    bounds = [(r["clip/lower"], r["clip/upper"]) for r in records]
    assert len(set(bounds)) == len(bounds), bounds
    for lower, upper in bounds[1:]:
        assert 0.05 < lower < 1.0 < upper < 20.0
    # log-space smoothing: log L_next = 0.5 log L_prev_next + 0.5 log L_target
    for prev, r in zip(records[1:], records[2:]):
        want = 0.5 * math.log(prev["clip/next_lower"]) + 0.5 * math.log(r["calib/lower_target"])
        assert math.log(r["clip/next_lower"]) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("pool", [1, 2])
def test_resume_in_the_middle_of_smoothing(dist_pool, tmp_path, pool):
    """pool 2: each calibration also reads the previous step's merged histogram, which must
    come back from the checkpoint for the resumed run to match."""
    pooled = {"clipping": {"calibration": {"pool_calibrations": pool}}}
    straight = dist_pool(2).run(_body, merge(_cfg(tmp_path, "straight"), pooled), timeout=600)[0][0]
    first = dist_pool(2).run(_body, merge(_cfg(tmp_path, "resumed", steps=2), pooled), timeout=600)[0][0]
    second = dist_pool(2).run(_body, merge(_cfg(tmp_path, "resumed"), pooled), timeout=600)[0][0]
    assert [r["step"] for r in second] == [2, 3]
    # the clipper at the resume point is not trivial: two smoothed calibrations behind it
    at_resume = first[-1]
    assert at_resume["calib/calibrations"] == 2.0 and at_resume["calib/fallback"] == 0.0
    assert (at_resume["clip/next_lower"], at_resume["clip/next_upper"]) != (0.6, 1.8)
    assert [_numbers(r) for r in first + second] == [_numbers(r) for r in straight]
    # what each calibration read: this step's tokens and, pooled, the previous step's
    for r in straight:
        s = r["step"]
        window = [_recorded(tmp_path / "straight" / "calib", t) for t in range(max(0, s - pool + 1), s + 1)]
        if not ((window[-1]["advantages"] < 0) & window[-1]["mask"]).any():
            window = window[-1:]  # a step without A < 0 tokens falls back on its own, unpooled
        assert r["calib/pooled_calibrations"] == len(window)
        assert r["calib/n_neg"] == sum(int(((d["advantages"] < 0) & d["mask"]).sum()) for d in window)
