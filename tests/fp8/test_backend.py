"""fp8.backend: which engine runs the FP8 GEMMs, and the `torch` backend (torch._scaled_mm on
our quantizer's codes) against the emulation, GEMM by GEMM (forward, dgrad, wgrad) and through
the tiny GPT at TP=2."""
from __future__ import annotations

import re

import pytest
import torch

from megatron_calibclip.config import ConfigError
from megatron_calibclip.fp8.gemm import using_gemm_path
from megatron_calibclip.fp8 import FP8Recipe
from megatron_calibclip.fp8.backend import _resolve, check_backend_supports
from megatron_calibclip.fp8.quantize import quantize
from megatron_calibclip.fp8.recipe import ROLE_VALUES
from megatron_calibclip.fp8.scaled_mm import scaled_mm
from tests.cuda_scaled_mm import CudaWouldRefuse, check, cuda_rules, cuda_scaled_mm_rules


@pytest.fixture(autouse=True)
def _cuda_rules():
    """Every torch._scaled_mm call of these tests must be one a CUDA device would accept
    (tests/cuda_scaled_mm.py); a test that installs its own kernel wraps it in cuda_rules."""
    with cuda_scaled_mm_rules() as checked:
        yield checked


# (requested, CUDA, TE installed) -> backend a run gets; with TE the trainer builds
# megatron's TE layer spec (trainer/te_run.py)
@pytest.mark.parametrize("requested, cuda, te, expected", [
    ("auto", True, True, "te"), ("auto", True, False, "torch"), ("auto", False, True, "emulated"),
    ("auto", False, False, "emulated"), ("torch", True, False, "torch"),
    ("emulated", True, True, "emulated"),
])
def test_resolution_for_a_run(requested, cuda, te, expected):
    backend, why = _resolve(requested, cuda, te, True)
    assert backend == expected and why


def test_resolution_for_a_linear():
    """One of our linears runs torch on the CPU too (what the tests below use); otherwise it
    resolves as the config check did, except that `auto` is never te: a model with our
    linears was not built from TE's spec."""
    assert _resolve("torch", False, False, True, for_run=False)[0] == "torch"
    assert _resolve("auto", True, True, True, for_run=False)[0] == "torch"
    assert _resolve("auto", False, True, True, for_run=False)[0] == "emulated"


@pytest.mark.parametrize("requested, cuda, te, message", [
    ("te", False, True, "missing here: a CUDA device); use 'emulated' or 'auto'"),
    ("te", True, False, "missing here: transformer-engine); use 'torch' or 'auto'"),
    ("te", False, False, "missing here: a CUDA device, transformer-engine)"),
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
    # a recipe that no FP8 GEMM reads (a BF16 run) is not checked
    bf16_run = {"precision": "bf16", "rollout": {"precision": "bf16"},
                "clipping": {"mode": "fixed"}, "fp8": {"backend": "torch"}}
    assert from_dict(TrainConfig, bf16_run).fp8.backend == "torch"


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
    rtol = 2**-8 if granularity == "rowwise" else 1e-5  # rowwise GEMMs write BF16 (CUDA)
    assert torch.allclose(got.double(), want, rtol=rtol, atol=1e-5 * want.abs().max().item())


# dgrad (dY W) and wgrad (dY^T X) as _scaled_mm takes them: A [m, K] rows and B [n, K] rows,
# each quantized along the GEMM's reduction dim K (rowwise: one scale per row of A, per row of
# B); T = 30 tokens is not a multiple of 16 (the wgrad pads its K with zero codes)
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_backward_gemms_reduce_along_their_own_dim(granularity):
    from megatron_calibclip.fp8.scaled_mm import fp8_gemm, fp8_operand

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(30, 96, generator=gen) * torch.linspace(0.1, 4, 30).unsqueeze(1)
    w = torch.randn(80, 96, generator=gen) * 0.02
    dy = torch.randn(30, 80, generator=gen) * 1e-3
    recipe = FP8Recipe(format="hybrid", granularity=granularity)
    g = granularity

    def op(t, role, axis):
        return fp8_operand(quantize(t, recipe, role, axis=axis), axis, g)

    def deq(t, role, axis):
        return quantize(t, recipe, role, axis=axis).dequantize().double()

    cases = {  # name: (FP8 GEMM, float64 product of the dequantized operands)
        "dgrad": (fp8_gemm(op(dy, "grad", -1), op(w, "weight", 0)),
                  deq(dy, "grad", -1) @ deq(w, "weight", 0)),
        "wgrad": (fp8_gemm(op(dy, "grad", 0), op(x, "activation", 0)),
                  deq(dy, "grad", 0).t() @ deq(x, "activation", 0)),
    }
    for name, (got, want) in cases.items():
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        tol = 1e-5 * want.abs().max().item()
        rtol = 2**-8 if granularity == "rowwise" else 1e-5  # rowwise GEMMs write BF16 (CUDA)
        assert torch.allclose(got.double(), want, rtol=rtol, atol=tol), name
    if granularity == "rowwise":  # scales along the other dim cannot feed the GEMM
        with pytest.raises(ValueError, match="quantized along axis -1"):
            fp8_operand(quantize(w, recipe, "weight", axis=-1), 0, g)


def _linear_grads(backend: str, steps: int = 3, dims=(96, 80, 10), **recipe_kw):
    """(y, x.grad, w.grad) of the last of `steps` forward/backward passes of one FP8 linear
    (delayed scaling: its scales come from the earlier steps' amaxes)."""
    from megatron_calibclip.fp8.delayed import AmaxHistory
    from megatron_calibclip.fp8.linear import _EmulatedLinearFunction, _Gemm
    from megatron_calibclip.fp8.weight_cache import WeightCache

    recipe = FP8Recipe(backend=backend, amax_history_len=4, **recipe_kw)
    states = {role: AmaxHistory(recipe.element_format(role), recipe.amax_history_len,
                                recipe.amax_compute_algo, recipe.margin)
              for role in ROLE_VALUES} if recipe.granularity == "delayed" else None
    gemm = _Gemm("fp8", recipe, states, backend, WeightCache())
    gen = torch.Generator().manual_seed(9)
    d_in, d_out, seq = dims
    w = (torch.randn(d_out, d_in, generator=gen) * 0.05).requires_grad_(True)
    for step in range(steps):
        x = (torch.randn(3, seq, d_in, generator=gen)
             * torch.linspace(0.2, 3, seq).view(1, seq, 1)).requires_grad_(True)
        dy = torch.randn(3, seq, d_out, generator=gen) * torch.linspace(1e-4, 1e-2, d_out)
        w.grad = None
        y = _EmulatedLinearFunction.apply(x, w, None, gemm, False, None)
        y.backward(dy)
    return y.detach(), x.grad, w.grad


BACKWARD_CASES = [
    dict(granularity="tensorwise", format="hybrid"),
    dict(granularity="tensorwise", format="hybrid", power_of_two_scales=True),
    dict(granularity="delayed", format="hybrid"),
    dict(granularity="rowwise", format="hybrid"),
    dict(granularity="rowwise", format="hybrid", power_of_two_scales=True),
    dict(granularity="rowwise", format="e4m3"),
    dict(granularity="rowwise", format="hybrid", fp8_wgrad=False),
]


# CPU torch without AMX runs _scaled_mm as the emulation does: codes -> fp32 times the scales,
# then at::matmul (aten/src/ATen/native/cpu/Blas.cpp, _scaled_mm_out_cpu_emulated); with AMX
# it calls oneDNN, whose accumulation order is its own
_CPU_SCALED_MM_DEQUANTIZES = not (torch.backends.mkldnn.is_available()
                                  and torch.cpu._is_amx_tile_supported())


def _scales_after_sum(a, b, scale_a, scale_b, bias=None, out_dtype=torch.float32):
    """_scaled_mm as GPU kernels order it: the fp32 sum of code products, then the scales
    (and the bias, before the output's rounding)."""
    out = (a.float() @ b.float()) * scale_a * scale_b
    return (out if bias is None else out + bias.float()).to(out_dtype)


@pytest.mark.parametrize("kernel", ["cpu", "scales_after_sum"])
@pytest.mark.parametrize("kw", BACKWARD_CASES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_torch_backward_matches_the_emulation(monkeypatch, kw, kernel):
    """dgrad and wgrad through _scaled_mm against the emulation's fp32 GEMMs on the same codes.
    CPU torch's kernel dequantizes then multiplies as the emulation does: bit-identical. A
    kernel that scales the sum (GPU order) is bit-identical when every scale is a power of
    two; otherwise each dequantized operand rounds once (2**-24 relative per operand), which
    moves an fp32 dgrad/wgrad by <= 1e-6 of its largest value (measured <= 3.2e-7; elementwise
    relative differences reach 2e-3 where the sum cancels), and the forward's bf16 output
    by at most one bf16 step where that crosses a rounding boundary."""
    if kernel == "scales_after_sum":
        monkeypatch.setattr(torch, "_scaled_mm", cuda_rules(_scales_after_sum))
    with using_gemm_path("fp32"):  # the emulation's fp32 GEMMs on the dequantized codes
        emu, got = _linear_grads("emulated", **kw), _linear_grads("torch", **kw)
    pow2 = kw.get("power_of_two_scales", False)
    exact = (kernel == "cpu" and _CPU_SCALED_MM_DEQUANTIZES) or pow2
    rowwise_bf16 = kw["granularity"] == "rowwise"  # CUDA's rowwise GEMMs write BF16
    for name, a, b in zip(("y", "dgrad", "wgrad"), got, emu):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if rowwise_bf16 and name != "y" and not (name == "wgrad" and not kw.get("fp8_wgrad",
                                                                               True)):
            scale = b.abs().max().item()  # one BF16 rounding of the fp32 sum
            assert torch.allclose(a, b, rtol=2**-8, atol=1e-6 * scale), name
            assert torch.equal(a, a.bfloat16().float()), name
        elif exact:
            assert torch.equal(a, b), name
        elif name == "y":
            assert torch.allclose(a, b, rtol=2**-7, atol=0), name
        else:
            scale = b.abs().max().item()
            assert torch.allclose(a, b, rtol=0, atol=1e-6 * scale), \
                (name, (a - b).abs().max().item() / scale)


@pytest.mark.parametrize("fp8_wgrad", [True, False])
def test_torch_backward_goes_through_scaled_mm(monkeypatch, fp8_wgrad):
    """The backward's GEMMs are real FP8 GEMMs: dgrad reads the E5M2 gradient (hybrid) and the
    E4M3 weight, wgrad the transposed E5M2 gradient and E4M3 input (BF16 wgrad: no FP8 GEMM)."""
    calls = []
    real = torch._scaled_mm

    def recording(a, b, *args, **kwargs):
        calls.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", cuda_rules(recording))
    _linear_grads("emulated", steps=1, granularity="rowwise", format="hybrid",
                  fp8_wgrad=fp8_wgrad)
    assert calls == []
    _linear_grads("torch", steps=1, granularity="rowwise", format="hybrid", fp8_wgrad=fp8_wgrad)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    want = [(e4, e4, (30, 96), (96, 80)),  # forward: x [T, in] @ W^T
            (e5, e4, (30, 80), (80, 96))]  # dgrad: dY [T, out] @ W
    if fp8_wgrad:  # dY^T [out, T] @ X [T, in], T = 30 padded to 32 (cuBLASLt needs K % 16)
        want.append((e5, e4, (80, 32), (32, 96)))
    assert calls == want


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_torch_backend_caches_codes_not_a_dequantized_copy(granularity):
    """On a GPU the weight cache must not hold a 4-byte copy of every weight beside its
    1-byte codes: the torch backend never reads the dequantized forward copy."""
    from megatron_calibclip.fp8.linear import _EmulatedLinearFunction, _Gemm
    from megatron_calibclip.fp8.weight_cache import WeightCache

    w = (torch.randn(48, 64, generator=torch.Generator().manual_seed(1)) * 0.05)
    w.requires_grad_(True)
    for backend, native, kept in (("torch", False, False), ("emulated", False, True),
                                  ("emulated", True, False)):  # native: bf16 codes instead
        cache = WeightCache()
        gemm = _Gemm("fp8", FP8Recipe(backend=backend, granularity=granularity), None, backend,
                     cache, native)
        x = torch.randn(2, 8, 64, requires_grad=True)
        _EmulatedLinearFunction.apply(x, w, None, gemm, False, None).sum().backward()
        assert (cache._entry._forward is not None) == kept, backend
        assert cache._entry.quantized.data.element_size() == 1


def test_verify_mode_compares_the_dgrad_codes():
    """CALIBCLIP_WEIGHT_CACHE=verify recomputes the weight's dgrad codes too: a stale copy of
    them (the weight changed behind the cache's back) is caught."""
    from megatron_calibclip.fp8.weight_cache import (StaleWeightCacheError, WeightCache,
                                                     set_weight_cache_policy)

    recipe = FP8Recipe(granularity="rowwise", backend="torch")
    w = torch.randn(80, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    cache = WeightCache()
    try:
        set_weight_cache_policy("verify")
        entry = cache.operands(w, recipe)
        dgrad = entry.dgrad_operand()
        assert dgrad.codes.shape == (96, 80) and dgrad.scale.shape == (96, 1)
        assert cache.operands(w, recipe) is entry  # a hit that verifies clean
        dgrad.codes[0, 0] = 2.0 if dgrad.codes[0, 0].float().item() != 2.0 else 1.0  # stale
        with pytest.raises(StaleWeightCacheError):
            cache.operands(w, recipe)
    finally:
        set_weight_cache_policy(None)


def _model_body(rank, world_size, granularity):
    from megatron_calibclip.fp8 import fp8_linear_classes, set_precision
    from megatron_calibclip.fp8.gemm import using_gemm_path
    from megatron_calibclip.models import build_policy_model, get_preset, local_layer_spec
    from megatron_calibclip.parallel import model_parallel

    out = {"scaled_mm_calls": 0}
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        out["scaled_mm_calls"] += 1
        return real(*args, **kwargs)

    from tests.cuda_scaled_mm import cuda_rules

    torch._scaled_mm = cuda_rules(counting)
    with model_parallel(tp=2):
        cfg = get_preset("tiny")
        model = build_policy_model(cfg, spec=local_layer_spec(cfg, **fp8_linear_classes()), seed=0)
        tokens = torch.randint(1, 1000, (3, 40), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(40).expand(3, -1)
        # the fp32 emulation (gemm path "fp32", every GEMM an fp32 GEMM) beside the torch
        # backend on the same path for its BF16 GEMMs, and the native kernels
        for backend, path in (("emulated", "fp32"), ("torch", "fp32"), ("native", "native")):
            set_precision(model, "fp8", FP8Recipe(
                granularity=granularity, backend="torch" if backend == "torch" else "emulated",
                amax_history_len=4))
            for m in model.modules():  # the same delayed-scaling history for both
                if hasattr(m, "reset_fp8_state"):
                    m.reset_fp8_state()
            model.zero_grad()
            with using_gemm_path(path):
                logits = model(tokens, pos, None)
                logits.float().pow(2).mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            out[backend] = (logits.detach(), grads)
            out[f"calls_{backend}"] = out["scaled_mm_calls"]
    torch._scaled_mm = real
    return out


@pytest.mark.dist
@pytest.mark.parametrize("granularity", ["tensorwise", "delayed", "rowwise"])
def test_torch_backend_matches_the_emulation_through_the_model(dist_pool, granularity):
    for out in dist_pool(2).run(_model_body, granularity):
        # 4 linears x 2 layers, each three real FP8 GEMMs (forward, dgrad, wgrad), only under
        # the torch backend
        assert (out["calls_emulated"], out["calls_torch"], out["calls_native"]) == (0, 24, 24)
        (l_emu, g_emu), (l_torch, g_torch) = out["emulated"], out["torch"]
        if _CPU_SCALED_MM_DEQUANTIZES:  # the same codes, scales and fp32 GEMMs: bit for bit
            assert torch.equal(l_torch, l_emu)
            if granularity != "rowwise":  # (CUDA's rowwise dgrad / wgrad write BF16)
                assert all(torch.equal(g_torch[name], grad) for name, grad in g_emu.items())
        for name, grad in g_emu.items():
            assert torch.allclose(g_torch[name], grad, rtol=0.05,
                                  atol=0.05 * grad.abs().max().item()), name
        scale = l_emu.abs().max().item()
        # Where CPU _scaled_mm is oneDNN's own FP8 GEMM (AMX CPUs), it sums in another order:
        # an activation may then round to a neighbouring BF16 value and an FP8 code downstream
        # flip, as on the native path below (measured on a Xeon with AMX, tensorwise: 0.5% of
        # the logits differ, by at most 1.3e-3 of the largest; delayed and rowwise equal).
        tol = 1e-5 if _CPU_SCALED_MM_DEQUANTIZES else 2e-2
        assert torch.allclose(l_torch, l_emu, rtol=tol, atol=tol * scale)
        # the native kernels: scales after the fp32 sum (GPU order), BF16 GEMMs elsewhere
        l_nat, g_nat = out["native"]
        assert torch.allclose(l_nat, l_emu, rtol=2e-2, atol=2e-2 * scale)
        # BF16 dgrads move E5M2 codes downstream (one E5M2 step is 12-25% of a value), so
        # the gradients are compared as wholes: measured <= 5.1% of the norm, asserted 10%
        for name, grad in g_emu.items():
            assert (g_nat[name] - grad).norm() <= 0.1 * grad.norm(), name
        for name, grad in g_emu.items():
            if granularity == "rowwise":  # (rowwise: BF16 dgrad / wgrad, checked above)
                continue
            if _CPU_SCALED_MM_DEQUANTIZES:
                assert torch.allclose(g_torch[name], grad, rtol=1e-4, atol=1e-6), name
            else:  # oneDNN's summation order flips E5M2 codes as the native path does: as
                # wholes (measured on a Xeon with AMX: <= 4.3% of the norm, asserted 10%)
                assert (g_torch[name] - grad).norm() <= 0.1 * grad.norm(), name


@pytest.mark.parametrize("kw", BACKWARD_CASES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_torch_backend_pads_odd_sizes_as_cuda_needs(_cuda_rules, kw):
    """in = 40, out = 50, 21 tokens: none a multiple of 16. Every GEMM (forward, dgrad,
    wgrad) passes CUDA's checks (the autouse stand-in) and equals the emulation on the same
    codes (rowwise GEMMs write BF16: one rounding)."""
    with using_gemm_path("fp32"):
        emu = _linear_grads("emulated", dims=(40, 50, 7), **kw)
    got = _linear_grads("torch", dims=(40, 50, 7), **kw)
    assert _cuda_rules.calls and set(_cuda_rules.calls) <= {"tensorwise", "rowwise"}
    for name, a, b in zip(("y", "dgrad", "wgrad"), got, emu):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=2**-7, atol=1e-6 * b.abs().max().item()), name


def _codes(shape, dtype=torch.float8_e4m3fn):
    return torch.randn(*shape).clamp(-4, 4).to(dtype)


@pytest.mark.parametrize("case, match", [
    ("k_not_16", "trailing dimension of mat1"),
    ("n_not_16", "must be divisible by 16"),
    ("e5m2_pair", "two Float8_e5m2"),
    ("mat2_row_major", "row-major and column-major"),
    ("rowwise_fp32_out", "BF16 output only"),
    ("rowwise_1d_scale", "Invalid scaling configuration"),
    ("bias_fp32_out", "Bias needs a BF16 output"),
    ("not_fp8", "Expected Float8"),
])
def test_the_stand_in_refuses_what_cuda_refuses(case, match):
    a, b = _codes((32, 64)), _codes((48, 64)).t()  # row-major [M, K], column-major [K, N]
    one = torch.ones(())
    args = dict(scale_a=one, scale_b=one, bias=None, out_dtype=torch.float32)
    if case == "k_not_16":
        a, b = _codes((32, 40)), _codes((48, 40)).t()
    elif case == "n_not_16":
        b = _codes((50, 64)).t()
    elif case == "e5m2_pair":
        a, b = _codes((32, 64), torch.float8_e5m2), _codes((48, 64), torch.float8_e5m2).t()
    elif case == "mat2_row_major":
        b = _codes((64, 48))
    elif case == "rowwise_fp32_out":
        args.update(scale_a=torch.ones(32, 1), scale_b=torch.ones(1, 48))
    elif case == "rowwise_1d_scale":
        args.update(scale_a=torch.ones(32), scale_b=torch.ones(48), out_dtype=torch.bfloat16)
    elif case == "bias_fp32_out":
        args.update(bias=torch.zeros(48, dtype=torch.bfloat16))
    elif case == "not_fp8":
        a = a.float()
    with pytest.raises(CudaWouldRefuse, match=match):
        check(a, b, **args)
    # the same call with the rule kept is accepted
    assert check(_codes((32, 64)), _codes((48, 64)).t(), one, one) == "tensorwise"
    assert check(_codes((32, 64)), _codes((48, 64)).t(), torch.ones(32, 1), torch.ones(1, 48),
                 torch.zeros(48, dtype=torch.bfloat16), torch.bfloat16) == "rowwise"
