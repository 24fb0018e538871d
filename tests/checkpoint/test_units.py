"""Single-process units: the mapping table, HF config parsing, bf16 tie removal, disk layout."""
from __future__ import annotations

import pytest
import torch

from megatron_calibclip.checkpoint import layout as disk
from megatron_calibclip.checkpoint import mapping
from megatron_calibclip.checkpoint.errors import CheckpointError, ConversionError
from megatron_calibclip.checkpoint.hf_config import model_config_from_hf
from megatron_calibclip.checkpoint.ties import bf16_tie_mask, break_bf16_ties
from megatron_calibclip.models import get_preset

HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}


def test_qkv_interleaves_whole_groups_and_inverts_exactly():
    cfg = get_preset("tiny-qwen3")  # 4 heads, 2 groups, head_dim 32
    rule = next(r for r in mapping.LAYER_RULES if isinstance(r, mapping.QKV))
    d, h = cfg.head_dim, cfg.hidden_size
    q = torch.arange(4 * d).float()[:, None].expand(4 * d, h) + 0.0
    k = 1000 + torch.arange(2 * d).float()[:, None].expand(2 * d, h)
    v = 2000 + torch.arange(2 * d).float()[:, None].expand(2 * d, h)
    fused = rule.to_mcore(cfg, [q, k, v])
    assert fused.shape == rule.mcore_shape(cfg) == (8 * d, h)
    # group 0 = [q heads 0,1; k head 0; v head 0], then group 1
    assert torch.equal(fused[: 2 * d], q[: 2 * d])
    assert torch.equal(fused[2 * d: 3 * d], k[:d]) and torch.equal(fused[3 * d: 4 * d], v[:d])
    assert torch.equal(fused[4 * d: 6 * d], q[2 * d:])
    back = rule.to_hf(cfg, fused)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_gated_mlp_is_gate_then_up():
    cfg = get_preset("tiny")
    rule = next(r for r in mapping.LAYER_RULES if isinstance(r, mapping.GatedMLP))
    gate, up = torch.randn(128, 64), torch.randn(128, 64)
    fc1 = rule.to_mcore(cfg, [gate, up])
    assert torch.equal(fc1[:128], gate) and torch.equal(fc1[128:], up)
    assert all(torch.equal(a, b) for a, b in zip(rule.to_hf(cfg, fc1), (gate, up)))


@pytest.mark.parametrize("preset,per_layer,globals_", [
    ("tiny", 6, 2), ("tiny-qwen2", 7, 3), ("tiny-qwen3", 8, 3)])
def test_resolve_has_one_entry_per_tensor(preset, per_layer, globals_):
    cfg = get_preset(preset)
    entries = mapping.resolve(cfg)
    assert len(entries) == globals_ + per_layer * cfg.num_layers
    assert len({e.mcore for e in entries}) == len(entries)
    hf = [n for e in entries for n in e.hf]
    assert len(hf) == len(set(hf))


def test_local_spec_norm_names_map_to_checkpoint_names():
    assert mapping.local_to_checkpoint_name("decoder.layers.3.input_layernorm.weight") == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert mapping.local_to_checkpoint_name("decoder.layers.0.pre_mlp_layernorm.weight") == \
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"


def test_hf_config_fields():
    cfg = model_config_from_hf(HF_LLAMA)
    assert (cfg.family, cfg.rope_theta, cfg.norm_eps, cfg.kv_channels) == ("llama", 5e5, 1e-5, None)
    old_style = dict(HF_LLAMA, rope_theta=1e4)
    del old_style["rope_parameters"]
    assert model_config_from_hf(old_style).rope_theta == 1e4  # transformers 4.x layout
    q3 = dict(HF_LLAMA, model_type="qwen3", head_dim=32, tie_word_embeddings=True)
    cfg = model_config_from_hf(q3)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.kv_channels == 32 and cfg.tie_embeddings
    assert model_config_from_hf(dict(HF_LLAMA, model_type="qwen2")).qkv_bias


@pytest.mark.parametrize("change,words", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ["GPT2LMHeadModel", "gpt2"]),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, ["llama3"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"hidden_act": "gelu"}, ["gelu"]),
    ({"num_key_value_heads": 3}, ["num_query_groups"]),
])
def test_hf_config_rejects_what_we_do_not_model(change, words):
    with pytest.raises(ConversionError) as err:
        model_config_from_hf(dict(HF_LLAMA, **change), "x/config.json")
    assert all(w in str(err.value) for w in words) and "x/config.json" in str(err.value)


def test_bf16_ties_are_broken_below_half_a_step_in_random_directions():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(20000, generator=g).to(torch.bfloat16).float()
    step = (base.view(torch.int32) + (1 << 16)).view(torch.float32) - base  # next bf16 away from 0
    ties = base + step / 2  # exactly halfway (exact in fp32)
    values = torch.where(torch.arange(base.numel()) % 3 == 0, ties, base + step / 4)
    assert int(bf16_tie_mask(values).sum()) == (base.numel() + 2) // 3
    out, counts = break_bf16_ties({"w": values, "h": values.half()}, seed=1)
    w = out["w"]
    assert counts == {"w": (base.numel() + 2) // 3} and out["h"] is not None
    assert not bool(bf16_tie_mask(w).any())
    moved = w != values
    assert torch.equal(moved, bf16_tie_mask(values))  # only ties move
    assert bool(((w - values).abs()[moved] < step.abs()[moved] / 2).all())
    away = (w.to(torch.bfloat16).float() != base)[moved].float().mean()
    assert 0.45 < float(away) < 0.55  # rounding direction decided at random
    again, _ = break_bf16_ties({"h": values.half(), "w": values}, seed=1)
    assert torch.equal(again["w"], w)  # seeded per name, independent of order
    other, _ = break_bf16_ties({"w": values}, seed=2)
    assert not torch.equal(other["w"], w)


def test_commit_latest_prune_and_stale(tmp_path):
    root = tmp_path
    assert disk.read_latest(root) is None
    for step in (1, 2, 3):
        tmp = root / f"{disk.TMP_PREFIX}{disk.step_dirname(step)}"
        tmp.mkdir()
        (tmp / "metadata.json").write_text("{}")
        disk.commit(tmp, root / disk.step_dirname(step))
    assert disk.read_latest(root).name == "step_00000003"
    again = root / ".tmp.again"
    again.mkdir()
    assert disk.commit(again, root / "step_00000003").name == "step_00000003.1"
    assert disk.read_latest(root).name == "step_00000003.1"
    assert not (root / "step_00000003").exists() and disk.step_of("step_00000003.1") == 3
    assert disk.resolve_checkpoint(root) == root / "step_00000003.1"
    (root / ".tmp.step_00000004").mkdir()
    assert [p.name for p in disk.remove_stale(root)] == [".tmp.step_00000004"]
    assert [p.name for p in disk.prune(root, 2)] == ["step_00000001"]
    (root / "latest").write_text("step_00000009\n")
    with pytest.raises(CheckpointError, match="step_00000009"):
        disk.read_latest(root)
    with pytest.raises(CheckpointError, match="does not exist"):
        disk.resolve_checkpoint(tmp_path / "nope")
