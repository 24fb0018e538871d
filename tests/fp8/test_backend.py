"""fp8.backend: which engine runs the FP8 GEMMs, and the `torch` backend (torch._scaled_mm on
our quantizer's codes) against the emulation, GEMM by GEMM and through the tiny GPT at TP=2."""
from __future__ import annotations

import re

import pytest
import torch

from megatron_calibclip.config import ConfigError
from megatron_calibclip.fp8 import FP8Recipe
from megatron_calibclip.fp8.backend import _resolve, check_backend_supports
from megatron_calibclip.fp8.quantize import quantize
from megatron_calibclip.fp8.scaled_mm import scaled_mm


# (requested, CUDA, TE installed) -> backend a run gets; the trainer does not build TE's
# layer spec yet (TRAINER_BUILDS_TE), so `auto` takes torch on a GPU with TE
@pytest.mark.parametrize("requested, cuda, te, expected", [
    ("auto", True, True, "torch"), ("auto", True, False, "torch"), ("auto", False, True, "emulated"),
    ("auto", False, False, "emulated"), ("torch", True, False, "torch"),
    ("emulated", True, True, "emulated"),
])
def test_resolution_for_a_run(requested, cuda, te, expected):
    backend, why = _resolve(requested, cuda, te, True)
    assert backend == expected and why


def test_resolution_for_a_linear():
    """One of our linears runs torch on the CPU too (what the tests below use), and would take
    te on a GPU with TE when asked by a model built with TE's spec."""
    assert _resolve("torch", False, False, True, for_run=False)[0] == "torch"
    assert _resolve("auto", True, True, True, for_run=False)[0] == "te"
    assert _resolve("auto", False, True, True, for_run=False)[0] == "emulated"


@pytest.mark.parametrize("requested, cuda, te, message", [
    ("te", False, True, "missing here: a CUDA device); use 'emulated' or 'auto'"),
    ("te", True, False, "missing here: transformer-engine); use 'torch' or 'auto'"),
    ("te", False, False, "missing here: a CUDA device, transformer-engine)"),
    ("te", True, True, "'te' is not wired into the trainer yet"),
    ("torch", False, True, "'torch' runs real FP8 GEMMs on a CUDA device and there is none"),
])
def test_backends_a_run_cannot_use_are_refused(requested, cuda, te, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _resolve(requested, cuda, te, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a CPU machine answers")
def test_on_the_cpu_a_training_config_takes_emulated_and_refuses_te_and_torch():
    """Issue 11's must-show, through the config a user writes: auto -> emulated; te and torch
    fail when the config is read, each with one line that says why."""
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig
    from megatron_calibclip.fp8.backend import resolve_backend

    assert resolve_backend("auto")[0] == "emulated"
    assert from_dict(TrainConfig, {"fp8": {"backend": "auto"}}).fp8.backend == "auto"
    for section in ("fp8", "rollout.fp8"):
        for backend, why in (("te", "needs a CUDA device and transformer-engine"),
                             ("torch", "runs real FP8 GEMMs on a CUDA device")):
            cfg = {"fp8": {"backend": backend}} if section == "fp8" else \
                {"rollout": {"fp8": {"backend": backend}}}
            with pytest.raises(ConfigError) as err:
                from_dict(TrainConfig, cfg)
            text = str(err.value)
            assert text.startswith(f"{section}.backend: '{backend}'") and why in text
            assert "\n" not in text


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
