"""fp8.backend: which engine runs the FP8 GEMMs, and the `torch` backend (torch._scaled_mm on
our quantizer's codes) against the emulation, GEMM by GEMM and through the tiny GPT at TP=2."""
from __future__ import annotations

import pytest
import torch

from megatron_calibclip.config import ConfigError
from megatron_calibclip.fp8 import FP8Recipe
from megatron_calibclip.fp8.backend import _resolve, check_backend_supports
from megatron_calibclip.fp8.quantize import quantize
from megatron_calibclip.fp8.scaled_mm import scaled_mm


@pytest.mark.parametrize("requested, cuda, te, expected", [
    ("auto", True, True, "te"), ("auto", True, False, "torch"), ("auto", False, True, "emulated"),
    ("auto", False, False, "emulated"), ("torch", False, False, "torch"),
    ("emulated", True, True, "emulated"), ("te", True, True, "te"),
])
def test_resolution(requested, cuda, te, expected):
    backend, why = _resolve(requested, cuda, te, True)
    assert backend == expected and why


@pytest.mark.parametrize("cuda, te, missing", [(False, True, "a CUDA device"),
                                               (True, False, "transformer-engine"),
                                               (False, False, "a CUDA device, transformer-engine")])
def test_te_without_its_requirements_is_refused(cuda, te, missing):
    with pytest.raises(ConfigError, match=f"missing here: {missing}\\)"):
        _resolve("te", cuda, te, True)


def test_bad_values_are_refused():
    with pytest.raises(ConfigError, match="fp8.backend: 'cuda' is not one of"):
        FP8Recipe(backend="cuda")
    with pytest.raises(ConfigError, match="'blockwise' needs torch's block-scaled GEMMs"):
        check_backend_supports("torch", "blockwise")
    check_backend_supports("emulated", "mxfp8")  # the emulation runs every recipe


@pytest.mark.parametrize("granularity, pow2", [("tensorwise", None), ("tensorwise", True),
                                               ("rowwise", None), ("rowwise", True)])
@pytest.mark.parametrize("k", [256, 4096])
def test_scaled_mm_matches_the_dequantized_gemm(granularity, pow2, k):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(32, k, generator=gen) * torch.linspace(0.1, 4, 32).unsqueeze(1)
    w = torch.randn(48, k, generator=gen) * 0.02
    recipe = FP8Recipe(granularity=granularity, power_of_two_scales=pow2)
    qx, qw = quantize(x, recipe, "activation"), quantize(w, recipe, "weight")
    got = scaled_mm(qx, qw, 32, 48, granularity)
    want = qx.dequantize().double() @ qw.dequantize().double().t()  # float64: the exact value
    assert got.dtype == torch.float32 and got.shape == (32, 48)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _model_body(rank, world_size, granularity):
    import megatron_calibclip.fp8.linear as linear
    from megatron_calibclip.fp8 import fp8_linear_classes, set_precision
    from megatron_calibclip.models import build_policy_model, get_preset, local_layer_spec
    from megatron_calibclip.parallel import model_parallel

    out = {"scaled_mm_calls": 0}
    real = linear.scaled_mm

    def counting(*args, **kwargs):
        out["scaled_mm_calls"] += 1
        return real(*args, **kwargs)

    linear.scaled_mm = counting
    with model_parallel(tp=2):
        cfg = get_preset("tiny")
        model = build_policy_model(cfg, spec=local_layer_spec(cfg, **fp8_linear_classes()), seed=0)
        tokens = torch.randint(1, 1000, (3, 40), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(40).expand(3, -1)
        for backend in ("emulated", "torch"):
            set_precision(model, "fp8", FP8Recipe(granularity=granularity, backend=backend,
                                                  amax_history_len=4))
            for m in model.modules():  # the same delayed-scaling history for both
                if hasattr(m, "reset_fp8_state"):
                    m.reset_fp8_state()
            model.zero_grad()
            logits = model(tokens, pos, None)
            logits.float().pow(2).mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            out[backend] = (logits.detach(), grads)
            out[f"calls_{backend}"] = out["scaled_mm_calls"]
    linear.scaled_mm = real
    return out


@pytest.mark.dist
@pytest.mark.parametrize("granularity", ["tensorwise", "delayed", "rowwise"])
def test_torch_backend_matches_the_emulation_through_the_model(dist_pool, granularity):
    for out in dist_pool(2).run(_model_body, granularity):
        # 4 linears x 2 layers, each one real FP8 GEMM, only under the torch backend
        assert (out["calls_emulated"], out["calls_torch"]) == (0, 8)
        (l_emu, g_emu), (l_torch, g_torch) = out["emulated"], out["torch"]
        scale = l_emu.abs().max().item()
        assert torch.allclose(l_torch, l_emu, rtol=1e-5, atol=1e-5 * scale)
        for name, grad in g_emu.items():
            assert torch.allclose(g_torch[name], grad, rtol=1e-4, atol=1e-6), name
