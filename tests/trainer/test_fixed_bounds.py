"""Fixed clipping with bounds of its own (clipping.fixed_lower / fixed_upper): the control arm of
the third reproduction round holds the bounds a calibrated run averaged. The loss must clip with
them, the BF16 counterfactual must keep the host's eps_low, and bad values fail in one line."""
import pytest

from tests.train_configs import TINY_TRAIN, merge


def _load(overrides: dict):
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig

    return from_dict(TrainConfig, merge(TINY_TRAIN, overrides))


@pytest.mark.parametrize("clipping, message", [
    ({"mode": "calibrated", "fixed_lower": 0.5}, "clipping.mode"),
    ({"mode": "fixed", "fixed_lower": 1.0}, "clipping.fixed_lower"),
    ({"mode": "fixed", "fixed_lower": 0.0}, "clipping.fixed_lower"),
    ({"mode": "fixed", "fixed_upper": 1.0}, "clipping.fixed_upper"),
    ({"mode": "fixed", "fixed_upper": float("inf")}, "clipping.fixed_upper"),
])
def test_fixed_bounds_bad_values_name_the_field(clipping, message):
    from megatron_calibclip.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _load({"clipping": clipping})


def test_fixed_bounds_default_to_the_host_bounds():
    cfg = _load({"clipping": {"mode": "fixed"}, "loss": {"eps_low": 0.2, "eps_high": 0.28}})
    assert cfg.clipping.fixed_bounds(cfg.loss.default_bounds) == pytest.approx((0.8, 1.28))
    cfg = _load({"clipping": {"mode": "fixed", "fixed_upper": 2.5}})
    assert cfg.clipping.fixed_bounds((0.8, 1.2)) == (0.8, 2.5)


def _train_body(rank, world_size, cfg_dict, out_dir):
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train

    cfg_dict = merge(cfg_dict, {"run": {"output_dir": out_dir}})
    return train(from_dict(TrainConfig, cfg_dict))["records"]


@pytest.mark.dist
def test_fixed_bounds_reach_the_loss_and_phantoms_keep_the_host_eps(dist_pool, tmp_path):
    """Tight bounds [0.999, 1.001]: the tiny model's ratios stay inside the host's [0.8, 1.2], so
    any clip at all is the fixed bounds' doing; the BF16 shadow is read at the host's 0.8 and
    clips nothing, so every FP8 lower clip is a phantom one."""
    cfg = merge(TINY_TRAIN, {
        "run": {"steps": 2, "name": "tight", "checkpoint": False, "plot": False, "tensorboard": False},
        "clipping": {"mode": "fixed", "fixed_lower": 0.999, "fixed_upper": 1.001},
        "diagnostics": {"shadow_every": 1}})
    records = dist_pool(2).run(_train_body, cfg, str(tmp_path), timeout=300)[0]
    trained = [r for r in records if "skipped" not in r]
    assert trained
    for r in records:
        assert (r["clip/lower"], r["clip/upper"]) == (0.999, 1.001)
    for r in trained:
        assert 0.8 < r["loss/ratio_min"] and r["loss/ratio_max"] < 1.2, r
        assert r["loss/shadow_clipfrac_lower"] == 0.0
        assert r["loss/phantom_clipfrac"] == r["loss/clipfrac_lower"]
    assert max(r["loss/clipfrac"] for r in trained) > 0.1
