"""Model configs and presets; the reference model; single-process model behaviour."""
import dataclasses

import pytest
import torch

from megatron_calibclip.config import ConfigError
from megatron_calibclip.models import PRESETS, ModelConfig, get_preset

# Parameter counts published on the model cards (total, in billions) and tolerance.
PUBLISHED_PARAMS = {
    "smollm2-135m": (0.1345, 0.01),
    "llama3-8b": (8.03, 0.01),
    "qwen3-8b": (8.19, 0.01),
    "qwen3-14b": (14.77, 0.01),
    "qwen2.5-32b": (32.76, 0.01),  # HF safetensors count; the card's prose says 32.5B
    "qwen3-32b": (32.76, 0.01),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_presets_match_published_parameter_counts(name):
    expected, rel = PUBLISHED_PARAMS[name]
    got = PRESETS[name].num_parameters() / 1e9
    assert abs(got - expected) / expected <= rel, f"{name}: {got:.3f}B vs {expected}B"


def test_family_switches():
    assert PRESETS["qwen2.5-32b"].qkv_bias and not PRESETS["qwen2.5-32b"].qk_norm
    assert PRESETS["qwen3-8b"].qk_norm and not PRESETS["qwen3-8b"].qkv_bias
    assert PRESETS["qwen3-32b"].head_dim == 128 != 5120 // 64
    assert PRESETS["smollm2-135m"].tie_embeddings and not PRESETS["llama3-8b"].tie_embeddings


@pytest.mark.parametrize("tp, expected", [(1, 1000), (2, 1008), (4, 1024), (8, 1024)])
def test_vocab_padding(tp, expected):
    cfg = get_preset("tiny")
    assert cfg.padded_vocab_size(tp) == expected
    assert cfg.padded_vocab_size(tp) % (cfg.make_vocab_size_divisible_by * tp) == 0


def test_llama3_vocab_padding_as_megatron_lm():
    cfg = PRESETS["llama3-8b"]
    assert cfg.padded_vocab_size(1) == 128256  # 1002 x 128: no padding at TP=1
    assert cfg.padded_vocab_size(8) == 129024  # next multiple of 128 x 8


@pytest.mark.parametrize("changes, match", [
    ({"num_attention_heads": 6, "num_query_groups": 4}, "must be a multiple of"),
    ({"hidden_size": 66}, "set model.kv_channels"),
    ({"num_layers": 0}, "num_layers must be >= 1"),
    ({"family": "gpt2"}, r"'gpt2' is not one of \['llama', 'qwen2', 'qwen3'\]"),
    ({"hidden_dim": 3}, r"unknown key\(s\) \['hidden_dim'\]"),
])
def test_invalid_model_config_names_the_field(changes, match):
    with pytest.raises(ConfigError, match=match):
        get_preset("tiny", **changes)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="not one of"):
        get_preset("gpt-5")


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match="must divide num_attention_heads"):
        get_preset("smollm2-135m").check_tensor_parallel(2)  # 9 heads, 3 groups


def _reference_body(rank, world_size):
    from megatron_calibclip.models import (
        build_policy_model,
        build_reference_model,
        copy_weights,
        forward_logits,
        shifted_logprobs_entropy,
    )
    from megatron_calibclip.parallel import model_parallel

    cfg = get_preset("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with model_parallel(tp=1):
        policy = build_policy_model(cfg, seed=3)
        ref = build_reference_model(cfg, seed=5)
        copy_weights(policy, ref)
        dtypes = {p.dtype for p in ref.parameters()}
        frozen = all(not p.requires_grad for p in ref.parameters())
        trainable = all(p.requires_grad for p in policy.parameters())
        with torch.no_grad():
            lp_pol, ent = shifted_logprobs_entropy(forward_logits(policy, tokens), tokens,
                                                   cfg.vocab_size)
            lp_ref, _ = shifted_logprobs_entropy(forward_logits(ref, tokens), tokens,
                                                 cfg.vocab_size)
        return {"dtypes": dtypes, "frozen": frozen, "trainable": trainable,
                "training": ref.training, "max_diff": float((lp_pol - lp_ref).abs().max()),
                "entropy": float(ent.mean())}


def test_reference_model_is_frozen_bf16_and_close_to_the_policy(dist_pool):
    out = dist_pool(1).run(_reference_body)[0]
    assert out["dtypes"] == {torch.bfloat16}
    assert out["frozen"] and out["trainable"] and not out["training"]
    # same weights (rounded to bf16): log-probs agree to bf16 precision, but not exactly
    assert 0 < out["max_diff"] < 0.05
    # a random tiny model is close to uniform over 1000 tokens: entropy near log(1000)
    assert 6.0 < out["entropy"] < 6.91


def test_model_config_is_frozen():
    cfg = get_preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]
    assert isinstance(cfg, ModelConfig)
