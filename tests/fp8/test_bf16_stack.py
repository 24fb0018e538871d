"""The bf16 stack around the emulated linears (models/bf16_stack.py): every parameter is seen
as its bf16 copy and every named boundary holds bf16 values in bf16/fp8 mode, none in fp32."""
from __future__ import annotations

import pytest
import torch

from megatron_calibclip.fp8 import FP8Recipe

pytestmark = pytest.mark.dist

MODES = [("bf16", None), ("fp8", FP8Recipe(granularity="tensorwise")),
         ("fp8", FP8Recipe(granularity="blockwise", format="hybrid")),
         ("fp8", FP8Recipe(granularity="delayed", amax_history_len=2, amax_reduction="none")),
         ("fp8", FP8Recipe(granularity="mxfp8"))]


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def _build(preset, seed=0):
    from megatron_calibclip.models import build_policy_model, emulated_layer_spec, get_preset

    cfg = get_preset(preset)
    return cfg, build_policy_model(cfg, spec=emulated_layer_spec(cfg), seed=seed)


def _logits(model, tokens):
    from megatron_calibclip.fp8 import reset_fp8_state

    reset_fp8_state(model)  # delayed scaling: the same (empty) history for every forward
    pos = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        return model(tokens, pos, None)


def _master_body(rank, world_size, preset):
    """Per parameter: round only it to bf16; the bf16/fp8 logits must not move."""
    from megatron_calibclip.fp8 import set_precision
    from megatron_calibclip.parallel import model_parallel

    out = {"moved": {}, "n_params": 0}
    with model_parallel(tp=1):
        cfg, model = _build(preset)
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(1, cfg.vocab_size, (2, 24), generator=gen)
        params = dict(model.named_parameters())
        out["n_params"] = len(params)
        with torch.no_grad():  # move every master off the bf16 grid (as fp32 updates do)
            for p in params.values():
                p.add_(torch.randn_like(p) * p.abs().mean().clamp(min=1e-3) * 1e-3)
        masters = {n: p.detach().clone() for n, p in params.items()}
        for mode, recipe in MODES + [("fp32", None)]:
            set_precision(model, mode, recipe)
            base = _logits(model, tokens)
            key = mode if recipe is None else f"fp8-{recipe.granularity}"
            moved = []
            for name, p in params.items():
                with torch.no_grad():
                    p.copy_(_bf16(masters[name]))
                if not torch.equal(_logits(model, tokens), base):
                    moved.append(name)
                with torch.no_grad():
                    p.copy_(masters[name])
            out["moved"][key] = moved
    return out


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2"])  # tiny-qwen2: qkv biases, untied
def test_every_parameter_is_seen_as_its_bf16_copy(dist_pool, preset):
    out = dist_pool(1).run(_master_body, preset)[0]
    for key, moved in out["moved"].items():
        if key == "fp32":  # the truth: rounding a master does change it
            assert len(moved) >= out["n_params"] // 2, moved
        else:
            assert moved == [], (key, moved)


def _boundaries_body(rank, world_size):
    """Capture the tensors at each named boundary; report which ones are bf16-valued."""
    import torch.nn.functional as F

    import megatron_calibclip.models.attention as attention
    from megatron_calibclip.fp8 import set_precision
    from megatron_calibclip.parallel import model_parallel

    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name, t):
        seen.setdefault(name, []).append(t.detach().float())

    def hook(name):
        def record(module, args, output):
            keep(name, output[0] if isinstance(output, tuple) else output)

        return record

    real_sdpa = F.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        for n, t in (("attention q", q), ("attention k", k), ("attention v", v)):
            keep(n, t)
        return real_sdpa(q, k, v, **kw)

    result = {}
    with model_parallel(tp=1):
        cfg, model = _build("tiny-qwen3")  # with QK-norm
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(1, cfg.vocab_size, (2, 24), generator=gen)
        model.embedding.register_forward_hook(hook("embedding output"))
        for layer in model.decoder.layers:
            layer.register_forward_hook(hook("residual stream (layer output)"))
            layer.pre_mlp_layernorm.register_forward_pre_hook(
                lambda m, args: keep("residual stream (after attention)", args[0]))
            for name in ("input_layernorm", "pre_mlp_layernorm"):
                getattr(layer, name).register_forward_hook(hook("norm output"))
            layer.self_attention.q_layernorm.register_forward_hook(hook("norm output"))
            layer.self_attention.core_attention.register_forward_hook(hook("attention output"))
            for lin in (layer.self_attention.linear_qkv, layer.self_attention.linear_proj,
                        layer.mlp.linear_fc1, layer.mlp.linear_fc2):
                lin.register_forward_hook(hook("linear output"))
        model.decoder.final_layernorm.register_forward_hook(hook("norm output"))
        attention.F.scaled_dot_product_attention = sdpa
        try:
            for mode, recipe in [("fp32", None)] + MODES:
                seen.clear()
                set_precision(model, mode, recipe)
                keep("logits", _logits(model, tokens))
                key = mode if recipe is None else f"fp8-{recipe.granularity}"
                result[key] = {name: all(torch.equal(t, _bf16(t)) for t in ts)
                               for name, ts in seen.items()}
        finally:
            attention.F.scaled_dot_product_attention = real_sdpa
    return result


def test_rounding_happens_at_each_named_boundary_and_nowhere_in_fp32(dist_pool):
    result = dist_pool(1).run(_boundaries_body)[0]
    names = {"embedding output", "norm output", "residual stream (after attention)",
             "residual stream (layer output)", "attention q", "attention k", "attention v",
             "attention output", "linear output", "logits"}
    for key, bf16_valued in result.items():
        assert set(bf16_valued) == names, (key, sorted(bf16_valued))
        if key == "fp32":
            assert not any(bf16_valued.values()), bf16_valued
        else:
            assert all(bf16_valued.values()), (key, bf16_valued)


def test_activation_precision_fp32_keeps_only_gemm_rounding():
    recipe = FP8Recipe(activation_precision="fp32", weight_source="fp32")
    assert (recipe.activation_precision, recipe.weight_source) == ("fp32", "fp32")
    with pytest.raises(Exception, match="activation_precision"):
        FP8Recipe(activation_precision="fp16")
