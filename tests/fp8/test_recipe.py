"""Recipe validation and the mapping onto megatron-core 0.16.1's TransformerConfig."""
import dataclasses
import typing

import pytest
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_calibclip.config import ConfigError
from megatron_calibclip.fp8 import FP8Recipe, apply_te_precision, te_config_kwargs, te_environment
from megatron_calibclip.fp8.te import TE_GRANULARITIES


def test_defaults_and_from_dict():
    r = FP8Recipe()
    assert (r.format, r.granularity) == ("e4m3", "tensorwise")
    assert r.linears == ("qkv", "proj", "fc1", "fc2")
    r2 = FP8Recipe.from_dict(
        {"format": "hybrid", "granularity": "blockwise", "linears": ["fc1", "fc2"]})
    assert r2.linears == ("fc1", "fc2") and r2.format == "hybrid"


GRAN = r"\['tensorwise', 'delayed', 'rowwise', 'blockwise', 'mxfp8'\]"
BAD = [
    ({"granularity": "rowise"}, r"fp8\.granularity: 'rowise' is not one of " + GRAN),
    ({"format": "e5m2"}, r"fp8\.format: 'e5m2' is not one of \['e4m3', 'hybrid'\]"),
    ({"amax_compute_algo": "mean"}, r"fp8\.amax_compute_algo: 'mean' is not one of"),
    ({"amax_reduction": "dp"}, r"fp8\.amax_reduction: 'dp' is not one of"),
    ({"linears": ["qkv", "out"]},
     r"fp8\.linears\[1\]: 'out' is not one of \['qkv', 'proj', 'fc1', 'fc2'\]"),
    ({"amax_history_len": 0}, r"fp8\.amax_history_len: must be an integer >= 1"),
    ({"margin": -1}, r"fp8\.margin: must be an integer >= 0"),
    ({"granularity": "mxfp8", "power_of_two_scales": False},
     r"fp8\.power_of_two_scales: .*\[None, True\]"),
    ({"granularity": "delayed", "power_of_two_scales": True},
     r"fp8\.power_of_two_scales: .*\[None, False\]"),
    ({"blocksize": 64}, r"fp8: unknown key\(s\) \['blocksize'\]; allowed keys are"),
]


@pytest.mark.parametrize("data, match", BAD)
def test_errors_name_the_field_and_allowed_values(data, match):
    with pytest.raises(ConfigError, match=match):
        FP8Recipe.from_dict(data)


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match=r"fp8\.granularity"):
        FP8Recipe(granularity="per-row")
    with pytest.raises(ConfigError, match=r"fp8\.linears: duplicate"):
        FP8Recipe(linears=("qkv", "qkv"))


def _literal_values(name):
    hints = typing.get_type_hints(TransformerConfig)
    tp = hints[name]
    args = typing.get_args(tp)
    lits = [a for a in args if typing.get_origin(a) is typing.Literal]
    if typing.get_origin(tp) is typing.Literal:
        return set(args)
    return set(typing.get_args(lits[0])) if lits else None


@pytest.mark.parametrize("granularity", TE_GRANULARITIES)
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_te_mapping_uses_real_transformer_config_fields(granularity, fmt):
    recipe = FP8Recipe(format=fmt, granularity=granularity, amax_history_len=16, margin=1,
                       amax_compute_algo="most_recent", amax_reduction="tp")
    kwargs = te_config_kwargs(recipe)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(kwargs) <= fields
    assert kwargs["fp8"] in _literal_values("fp8") and kwargs["fp8"] == fmt
    assert kwargs["fp8_recipe"] in _literal_values("fp8_recipe")
    assert kwargs["fp8_recipe"] == granularity
    assert kwargs["fp8_amax_compute_algo"] in _literal_values("fp8_amax_compute_algo")
    assert (kwargs["fp8_amax_history_len"], kwargs["fp8_margin"]) == (16, 1)
    assert kwargs["tp_only_amax_red"] is True
    assert kwargs["fp8_dot_product_attention"] is False and kwargs["fp8_param"] is False
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kwargs)
    assert cfg.fp8 == fmt and cfg.fp8_recipe == granularity


def test_te_mapping_rejects_what_te_cannot_express():
    with pytest.raises(ConfigError, match=r"fp8\.granularity: 'rowwise' has no Transformer Engine"):
        te_config_kwargs(FP8Recipe(granularity="rowwise"))
    with pytest.raises(ConfigError, match=r"fp8\.linears"):
        te_config_kwargs(FP8Recipe(linears=("fc1",)))
    with pytest.raises(ConfigError, match=r"fp8\.fp8_wgrad"):
        te_config_kwargs(FP8Recipe(granularity="blockwise", fp8_wgrad=False))
    assert te_config_kwargs(FP8Recipe(granularity="delayed", fp8_wgrad=False))["fp8_wgrad"] is False
    with pytest.raises(ConfigError, match=r"fp8\.amax_reduction"):
        te_config_kwargs(FP8Recipe(granularity="delayed", amax_reduction="none"))


def test_te_environment_for_scale_options():
    assert te_environment(FP8Recipe(granularity="blockwise")) == {}  # TE default: pow2
    assert te_environment(FP8Recipe(granularity="blockwise", power_of_two_scales=False)) == {
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert te_environment(FP8Recipe(power_of_two_scales=True)) == {
        "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "1"}


def test_apply_te_precision_toggles_the_config_in_place():
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert cfg.fp8 is None
    apply_te_precision(cfg, "fp8", FP8Recipe(format="hybrid", granularity="blockwise"))
    assert (cfg.fp8, cfg.fp8_recipe) == ("hybrid", "blockwise")
    apply_te_precision(cfg, "bf16", None)
    assert cfg.fp8 is None and cfg.fp8_recipe == "blockwise"
    with pytest.raises(ValueError, match="FP8Recipe"):
        apply_te_precision(cfg, "fp8", None)
