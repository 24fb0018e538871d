"""The probe in-process on the shared 2-rank gloo pool at TP=1 (both ranks compute the same
thing; no extra process start when tests/fp8 ran first): sampled responses, and --load of an
HF folder with rounding-tie dithering."""
import pytest


def _body(rank, world_size):
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.probe import ProbeConfig, run_fp8_noise

    cfg = ProbeConfig(model="tiny", tokens="samples", num_seqs=8, sample_len=12,
                      warmup_steps=15, recipes=("tensorwise", "rowwise"), lrs=(1e-5,),
                      old_micro_batch=4, micro_batch=3)
    with model_parallel(tp=1):
        return run_fp8_noise(cfg, log=lambda _m: None)


@pytest.mark.dist
def test_probe_measures_sampled_response_tokens(dist_pool):
    a, b = dist_pool(2).run(_body)
    assert a["sources"] == b["sources"]  # seeded: the same numbers on every rank
    data = a["data"]
    assert "response tokens only" in data["tokens"]
    # only responses count: at most 12 sampled tokens per sequence, EOS included
    assert 8 <= data["num_tokens"] <= 8 * 12
    assert sum(a["prob_buckets"]["count"]) == data["num_tokens"]
    assert data["layout_new_micro_batches"] == [3, 3, 2]
    layout = a["sources"]["layout"]
    assert layout["rowwise"]["noise_std_vs_fp32"] < 1e-6 < layout["tensorwise"]["noise_std_vs_fp32"]
    upd = a["sources"]["update_lr1e-05"]
    assert upd["rowwise"]["noise_std_vs_fp32"] > upd["bf16"]["noise_std_vs_fp32"] > 0


def _write_tiny_hf(folder):
    """A 2-layer Llama HF folder (config.json + safetensors) with bf16-exact weights, as a
    bf16 checkpoint has: ~6% of them sit on E4M3 ties under power-of-two scales."""
    import json

    import torch
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": True, "vocab_size": 512, "attention_bias": False,
           "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2}
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16).float()

    t = {"model.embed_tokens.weight": w(512, 64), "model.norm.weight": torch.ones(64)}
    for i in range(2):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": torch.ones(64),
                  p + "post_attention_layernorm.weight": torch.ones(64),
                  p + "self_attn.q_proj.weight": w(64, 64),
                  p + "self_attn.k_proj.weight": w(32, 64),
                  p + "self_attn.v_proj.weight": w(32, 64),
                  p + "self_attn.o_proj.weight": w(64, 64),
                  p + "mlp.gate_proj.weight": w(128, 64), p + "mlp.up_proj.weight": w(128, 64),
                  p + "mlp.down_proj.weight": w(64, 128)})
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"))


def _load_body(rank, world_size, folder):
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.probe import ProbeConfig, run_fp8_noise

    cfg = ProbeConfig(model="tiny", load=folder, dither_weights=0, num_seqs=4,
                      recipes=("blockwise",), lrs=(1e-6,), old_micro_batch=2, micro_batch=2)
    with model_parallel(tp=1):
        return run_fp8_noise(cfg, log=lambda _m: None)


@pytest.mark.dist
def test_probe_loads_an_hf_folder_and_dithers_ties(dist_pool, tmp_path):
    _write_tiny_hf(tmp_path / "hf")
    res = dist_pool(2).run(_load_body, str(tmp_path / "hf"))[0]
    model = res["model"]
    assert model["loaded_from"].endswith("hf") and res["warmup"]["steps"] == 0
    assert 0.04 < model["rounding_tie_frac_before"]["blockwise"] < 0.08  # bf16 checkpoint
    assert model["rounding_tie_frac"] == {"bf16": 0.0, "blockwise": 0.0}
    assert model["dithered_weights"] > 0
    assert "bytes" in res["data"]["tokenizer"]  # no tokenizer files in the folder
    s = res["sources"]["update_lr1e-06"]["blockwise"]
    assert 0 < s["noise_std_vs_fp32"] < 1.0
