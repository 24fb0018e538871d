"""LossConfig: one error per bad field (naming it and the allowed values), and the one
mapping of the trainer's YAML section onto it."""
import pytest

from megatron_calibclip.config import ConfigError
from megatron_calibclip.rl import LossConfig, PolicyLossConfig


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("loss_agg_mode", "mean", "token-mean"),
        ("kl_type", "k4", "k3"),
        ("correction", "icepop", "mis-seq"),
        ("mis_seq_weight", "arithmetic", "geometric"),
        ("log_ratio_clamp", 0.0, "> 0"),
        ("correction_cap", float("inf"), "positive finite"),
        ("max_response_length", 0, "positive int"),
        ("shadow_eps_low", 0.8 + 0.5, "(0, 1)"),
        ("shadow_eps_high", -0.1, "> 0"),
    ],
)
def test_bad_field_names_itself_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        LossConfig(**{field: value})
    assert str(err.value).startswith(f"{field}: {value!r} is invalid")
    assert allowed in str(err.value)


def test_dual_clip_c_is_checked_only_with_dual_clip():
    LossConfig(dual_clip=False, dual_clip_c=0.5)
    with pytest.raises(ConfigError, match="dual_clip_c: 1.0 is invalid"):
        LossConfig(dual_clip=True, dual_clip_c=1.0)


@pytest.mark.parametrize(
    "section, budget, expected",
    [  # what trainer/step.py passed as keywords before the records existed (0bffeb9)
        (dict(eps_low=0.2, eps_high=0.28, loss_agg_mode="token-mean", correction="tis", kl_coef=0.0),
         64, LossConfig(loss_agg_mode="token-mean", correction="tis", shadow_eps_low=0.2, shadow_eps_high=0.28)),
        (dict(loss_agg_mode="seq-mean-token-sum-norm", correction="none", dual_clip=True, dual_clip_c=2.5,
              kl_coef=1e-3, kl_type="k2", entropy_coef=0.01, correction_cap=3.0, log_ratio_clamp=10.0),
         64, LossConfig(loss_agg_mode="seq-mean-token-sum-norm", correction="none", dual_clip=True,
                        dual_clip_c=2.5, kl_coef=1e-3, kl_type="k2", entropy_coef=0.01, correction_cap=3.0,
                        log_ratio_clamp=10.0, max_response_length=64, shadow_eps_low=0.2, shadow_eps_high=0.2)),
        (dict(loss_agg_mode="seq-mean-token-sum-norm", max_response_length=32, correction="mis-seq",
              mis_seq_weight="geometric"),
         64, LossConfig(loss_agg_mode="seq-mean-token-sum-norm", max_response_length=32, correction="mis-seq",
                        mis_seq_weight="geometric", shadow_eps_low=0.2, shadow_eps_high=0.2)),
        (dict(loss_agg_mode="seq-mean-token-mean", max_response_length=32), 64,
         LossConfig(loss_agg_mode="seq-mean-token-mean", correction="tis", shadow_eps_low=0.2, shadow_eps_high=0.2)),
    ],
)
def test_yaml_section_maps_onto_the_loss_config_once(section, budget, expected):
    assert PolicyLossConfig(**section).loss_config(generation_budget=budget) == expected
