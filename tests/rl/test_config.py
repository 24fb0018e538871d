"""PolicyLossConfig: presets, validation through from_dict, and wiring into policy_loss."""
import pytest
import torch

from megatron_calibclip.config import ConfigError, from_dict
from megatron_calibclip.rl import PolicyLossConfig, dapo_loss_config, grpo_loss_config, policy_loss


def test_presets():
    dapo = dapo_loss_config()
    assert dapo.default_bounds == pytest.approx((0.8, 1.28))
    assert dapo.loss_agg_mode == "token-mean" and dapo.kl_coef == 0.0 and dapo.correction == "tis"
    grpo = grpo_loss_config(kl_type="k2")
    assert grpo.default_bounds == pytest.approx((0.8, 1.2))
    assert grpo.loss_agg_mode == "seq-mean-token-mean" and grpo.kl_type == "k2"


def test_from_dict_rejects_bad_values():
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        from_dict(PolicyLossConfig, {"loss_agg_mode": "mean"})
    with pytest.raises(ConfigError, match="eps_low"):
        from_dict(PolicyLossConfig, {"eps_low": 0.8 + 0.5})
    with pytest.raises(ConfigError, match="dual_clip_c"):
        from_dict(PolicyLossConfig, {"dual_clip": True, "dual_clip_c": 1.0})


def test_loss_kwargs_feed_policy_loss():
    cfg = from_dict(PolicyLossConfig, {"correction": "none", "loss_agg_mode": "seq-mean-token-sum-norm",
                                       "max_response_length": 8})
    lp = torch.zeros(2, 4)
    mask = torch.ones(2, 4, dtype=torch.bool)
    L, H = cfg.default_bounds
    loss, _ = policy_loss(lp, lp, torch.tensor([1.0, -1.0]), mask, clip_low=L, clip_high=H, **cfg.loss_kwargs())
    # r = 1: sequence sums -4 and +4, each divided by 8, mean over 2 sequences
    assert loss.item() == pytest.approx(0.0)
    loss, _ = policy_loss(lp, lp, torch.tensor([1.0, 1.0]), mask, clip_low=L, clip_high=H, **cfg.loss_kwargs())
    assert loss.item() == pytest.approx(-0.5)
