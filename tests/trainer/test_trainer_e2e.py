"""End-to-end RL steps on 2 gloo ranks (DP=2 and TP=2): GRPO and DAPO, fixed and calibrated."""
import math

import pytest

from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

BASE = TINY_TRAIN

# metrics every run must log (SPEC "Metrics every run logs" + issue 6)
REQUIRED = ["reward_mean", "accuracy", "response_length_mean", "loss/entropy_mean",
            "loss/kl_mean", "loss/clipfrac_lower", "loss/clipfrac_upper",
            "loss/mult_prob_error", "loss/ratio_mean", "loss/ratio_min", "loss/ratio_max",
            "clip/lower", "clip/upper", "grad_norm", "loss/total", "time/rollout",
            "time/logprobs", "time/update", "time/step"]
CALIBRATION_ONLY = ["loss/phantom_clipfrac", "loss/shadow_clipfrac_lower", "calib/alpha",
                    "time/shadow", "time/calibration"]


def _train_body(rank, world_size, cfg_dict, out_dir):
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train

    cfg_dict = merge(cfg_dict, {"run": {"output_dir": out_dir}})
    result = train(from_dict(TrainConfig, cfg_dict))
    return result["records"]


CASES = {
    "grpo-dp2-calibrated": {"parallel": {"tp": 1}, "optimizer": {"distributed": True},
                            "run": {"checkpoint": False}},
    "grpo-tp2-fixed": {"parallel": {"tp": 2}, "clipping": {"mode": "fixed"},
                       "rollout": {"precision": "bf16"}},
    "dapo-dp2-calibrated": {"algorithm": {"name": "dapo", "dynamic_sampling": True,
                                          "dynamic_sampling_max_rounds": 2,
                                          "overlong_max_length": 3, "overlong_cache_length": 1},
                            "loss": {"eps_high": 0.28, "loss_agg_mode": "token-mean",
                                     "kl_coef": 0.0, "correction": "mis-token"}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_end_to_end(dist_pool, tmp_path, case):
    cfg = merge(merge(BASE, CASES[case]), {"run": {"name": case}})
    results = dist_pool(2).run(_train_body, cfg, str(tmp_path), timeout=300)
    assert _same_numbers(results[0], results[1]), \
        "every rank must report the same metrics"
    records = results[0]
    assert [r["step"] for r in records] == list(range(4))
    trained = [r for r in records if "skipped" not in r]
    assert trained, "at least one step must train"
    calibrated = cfg["clipping"]["mode"] == "calibrated"
    for r in trained:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"step {r['step']}: missing metrics {missing}"
        correction = cfg.get("loss", {}).get("correction", "tis")
        assert ("loss/tis_clipfrac" if correction == "tis" else "loss/mis_maskfrac") in r
        assert math.isfinite(r["loss/total"]) and math.isfinite(r["grad_norm"])
        calib_step = calibrated and r["step"] % 2 == 0
        for k in CALIBRATION_ONLY:
            assert (k in r) == calib_step, (k, r["step"])
    # bounds change only after calibration steps (period 2: steps 0 and 2)
    bounds = [(r["clip/lower"], r["clip/upper"]) for r in records]
    for s in range(1, len(records)):
        if bounds[s] != bounds[s - 1]:
            assert calibrated and (s - 1) % 2 == 0, f"bounds changed at step {s}: {bounds}"
    if not calibrated:
        assert set(bounds) == {(0.8, 1.2)}
    run_dir = tmp_path / case
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 4
    assert (run_dir / "summary.png").stat().st_size > 10_000
    assert any((run_dir / "tensorboard").iterdir())
    if cfg["run"].get("checkpoint", True):
        assert (run_dir / "checkpoints" / "latest").is_file()
    if case.startswith("dapo"):
        assert any("dynamic_sampling/groups_seen" in r for r in records)


def _close(x, y):
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y)) or abs(x - y) < 1e-9
    return x == y


def _same_numbers(a, b):
    return all(ra.keys() == rb.keys() and all(
        _close(ra[k], rb[k]) for k in ra if not k.startswith("time/")) for ra, rb in zip(a, b))
