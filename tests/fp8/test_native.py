"""The native BF16 kernels (fp8/gemm.py, fp8/native.py) against float64 references built from
the quantizer's codes (bit-tested in test_reference.py), one linear at a time, so that no
earlier GEMM's rounding can move an input: what each GEMM must produce, and how far the
native path may be from the fp32 emulation (the bounds docs/trainer.md states)."""
import pytest
import torch

from megatron_calibclip.fp8 import FP8Recipe, quantize
from megatron_calibclip.fp8.gemm import bf16_linear, fp32_out_mm, using_gemm_path
from megatron_calibclip.fp8.linear import _EmulatedLinearFunction
from megatron_calibclip.fp8.linear_gemm import _Gemm
from megatron_calibclip.fp8.native import supports
from megatron_calibclip.fp8.weight_cache import WeightCache

BF16_EPS = torch.finfo(torch.bfloat16).eps  # one BF16 step, relative
F32_EPS = torch.finfo(torch.float32).eps


def _bf16_values(shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _steps_off(got, want64, slack=None):
    """(largest difference in BF16 steps of the exact value beyond `slack` (the fp32 sum's
    own error bound), fraction of elements that differ from the exact value rounded once)."""
    step = BF16_EPS * want64.abs().clamp(min=1e-30)
    diff = (got.double() - want64).abs()
    if slack is not None:
        diff = (diff - slack).clamp(min=0)
    rounded = want64.float().bfloat16().double()  # the exact value rounded once
    return (diff / step).max().item(), (got.double() != rounded).double().mean().item()


def _acc_bound(a64, b64, extra=0.0):
    """fp32 accumulation error bound of a64 @ b64^T (+ a term of size `extra`)."""
    return a64.shape[-1] * F32_EPS * (a64.abs() @ b64.abs().t() + extra)


def test_bf16_linear_rounds_once_with_its_bias():
    gen = torch.Generator().manual_seed(0)
    x, w, b = _bf16_values((64, 576), gen), _bf16_values((300, 576), gen), _bf16_values((300,), gen)
    exact = x.double() @ w.double().t() + b.double()
    got = bf16_linear(x, w, b)
    assert got.dtype == torch.bfloat16
    steps, frac = _steps_off(got, exact)
    # one rounding of the fp32 sum: a few elements off by one step (the fp32 sum's order)
    assert steps <= 1.0 and frac <= 2e-3
    # rounding the sum first and adding the bias after would round twice: many more off
    twice = ((x.double() @ w.double().t()).float().bfloat16().double() + b.double())
    assert _steps_off(twice.float().bfloat16(), exact)[1] > 0.05
    with pytest.raises(TypeError, match="bf16 operands"):
        bf16_linear(x.float(), w)


def test_fp32_out_mm_has_exact_products_and_an_unrounded_fp32_sum():
    gen = torch.Generator().manual_seed(1)
    k = 1024
    # BF16 values across a wide range (FP8 codes times scales are such values)
    a = (_bf16_values((96, k), gen) * torch.exp2(torch.randint(-8, 8, (96, k), generator=gen)
                                                  ).bfloat16())
    b = _bf16_values((80, k), gen, 0.01)
    exact = a.double() @ b.double().t()
    got = fp32_out_mm(a, b)
    assert got.dtype == torch.float32
    bound = k * F32_EPS * (a.double().abs() @ b.double().abs().t())  # fp32 accumulation
    assert bool(((got.double() - exact).abs() <= bound).all())
    # not rounded to BF16: almost no element is a BF16 number
    assert (got.bfloat16().float() == got).double().mean().item() < 0.02
    # fp32 operands holding BF16 values give the same result as BF16 operands
    assert torch.equal(fp32_out_mm(a.float(), b.float()), got)


def test_fp32_out_mm_on_other_devices_asks_torch_for_fp32_output_of_bf16_inputs():
    """Off the CPU the kernel is aten::mm.dtype (fp32 output of bf16 inputs): the meta device
    checks that torch accepts the call and what it returns, as CUDA would."""
    a = torch.empty(16, 32, device="meta")
    b = torch.empty(8, 32, device="meta", dtype=torch.bfloat16)
    out = fp32_out_mm(a, b)
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (16, 8)


CASES = [
    None,  # BF16 mode
    dict(format="e4m3", granularity="tensorwise"),
    dict(format="hybrid", granularity="tensorwise", power_of_two_scales=True),
    dict(format="hybrid", granularity="delayed"),
    dict(format="hybrid", granularity="rowwise"),
    dict(format="e4m3", granularity="rowwise", fp8_wgrad=False),
    dict(format="hybrid", granularity="blockwise"),
    dict(format="hybrid", granularity="mxfp8"),
]


def _dq64(t, recipe, role, axis=-1):
    state = None
    if recipe.granularity == "delayed":  # a first step: every delayed scale is still 1
        from megatron_calibclip.fp8.delayed import AmaxHistory

        state = AmaxHistory(recipe.element_format(role), 4, "max", 0)
    return quantize(t, recipe, role, axis=axis, state=state).dequantize(torch.float32).double()


def _references(recipe, x, w, b, dy):
    """float64 (y, dgrad, wgrad) from the same roundings / codes the GPU would use."""
    x2, g2 = x.reshape(-1, x.shape[-1]).float(), dy.reshape(-1, dy.shape[-1]).float()
    xb = x2.bfloat16().float()
    if recipe is None:
        xd, wd, gd = xb.double(), w.bfloat16().double(), g2.bfloat16().double()
        return xd @ wd.t() + b.bfloat16().double(), gd @ wd, gd.t() @ xd
    wb = w.bfloat16().float()
    y = _dq64(xb, recipe, "activation") @ _dq64(wb, recipe, "weight").t() + b.bfloat16().double()
    dgrad = _dq64(g2, recipe, "grad") @ _dq64(wb, recipe, "weight", axis=0)
    if recipe.fp8_wgrad:
        wgrad = _dq64(g2, recipe, "grad", axis=0).t() @ _dq64(xb, recipe, "activation", axis=0)
    else:
        wgrad = g2.bfloat16().double().t() @ xb.double()
    return y, dgrad, wgrad


def _run(kw, path, x, w, b, dy):
    recipe = FP8Recipe(amax_history_len=4, **kw) if kw else None
    states = None
    if recipe is not None and recipe.granularity == "delayed":
        from megatron_calibclip.fp8.delayed import AmaxHistory

        states = {r: AmaxHistory(recipe.element_format(r), 4, "max", 0)
                  for r in ("activation", "weight", "grad")}
    mode = "fp8" if kw else "bf16"
    gemm = _Gemm(mode, recipe, states, "emulated", WeightCache(),
                 native=path != "fp32" and (recipe is None or supports(recipe)),
                 exact=path == "exact")
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    y = _EmulatedLinearFunction.apply(x, w, b, gemm, False, None)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, recipe, gemm


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "bf16" if kw is None else "-".join(
    f"{v}" for v in kw.values()))
def _operands():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 50, 320, generator=gen) * torch.linspace(0.1, 4, 320)
    w = torch.randn(200, 320, generator=gen) * 0.05
    b = torch.randn(200, generator=gen) * 0.1
    dy = torch.randn(4, 50, 200, generator=gen) * 1e-3
    return x, w, b, dy


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "bf16" if kw is None else "-".join(
    f"{v}" for v in kw.values()))
def test_exact_path_against_exact_references(kw):
    """The "exact" path: BF16 kernels where their one rounding is exact, the fp32-output
    kernel elsewhere; what the fp32 emulation computes, up to the fp32 sum's order."""
    x, w, b, dy = _operands()
    y, dx, dw, recipe, gemm = _run(kw, "exact", x, w, b, dy)
    assert gemm.native
    y64, dx64, dw64 = _references(recipe, x, w, b, dy)
    # the BF16 output: the exact sum rounded once, up to the fp32 sum's order
    x64 = x.reshape(-1, x.shape[-1]).double()
    slack = _acc_bound(x64.abs() * 2, w.double().abs() * 2, b.double().abs())  # |q| <= 2|x|
    steps, frac = _steps_off(y.reshape(y64.shape), y64, slack)
    assert steps <= 1.0 and frac <= 2e-3, (steps, frac)
    # fp32 gradients (BF16 in bf16 mode for the dgrad): exact products, fp32 accumulation
    if recipe is None:
        steps, frac = _steps_off(dx.reshape(dx64.shape), dx64)
        assert steps <= 1.0 and frac <= 2e-3
    else:
        assert (dx.reshape(dx64.shape).double() - dx64).abs().max() <= 1e-5 * dx64.abs().max()
    assert (dw.double() - dw64).abs().max() <= 1e-5 * dw64.abs().max()
    # and the fp32 emulation of the same GEMMs, for the bound the docs state
    y32, dx32, dw32, _, _ = _run(kw, "fp32", x, w, b, dy)
    steps, _ = _steps_off(y, y32.double(), slack.reshape(y.shape))
    differ = (y != y32).double().mean().item()
    assert steps <= 2.0 and differ <= 2e-3, (steps, differ)  # each one rounding from exact
    if recipe is None:  # both BF16 dgrads: one rounding each from the exact value
        near = (dx - dx32).abs() <= 2 * BF16_EPS * dx32.abs() + 1e-6 * dx32.abs().max()
        assert bool(near.all()) and (dx != dx32).double().mean().item() <= 2e-3
    else:
        assert (dx - dx32).abs().max() <= 1e-5 * dx32.abs().max()
    assert (dw - dw32).abs().max() <= 1e-5 * dw32.abs().max()


def test_blockwise_with_fp32_scales_keeps_the_fp32_emulation():
    """code x an fp32 block scale is not a BF16 number, and the scale varies along K: no
    native kernel computes it exactly, so the linear stays on the fp32 GEMMs."""
    recipe = FP8Recipe(granularity="blockwise", power_of_two_scales=False)
    assert not supports(recipe)
    assert supports(FP8Recipe(granularity="blockwise")) and supports(FP8Recipe())


def test_native_caches_and_saves_bf16_not_fp32():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(30, 64, generator=gen).requires_grad_(True)
    w = (torch.randn(48, 64, generator=gen) * 0.1).requires_grad_(True)
    for kw in (None, dict(granularity="tensorwise")):
        recipe = FP8Recipe(**kw) if kw else None
        cache = WeightCache()
        gemm = _Gemm("fp8" if kw else "bf16", recipe, None, "emulated", cache, native=True)
        y = _EmulatedLinearFunction.apply(x, w, None, gemm, False, None)
        entry = cache._entry
        assert entry._forward is None  # no fp32 copy of the weight
        if kw is None:
            assert entry.bf16_copy.dtype == torch.bfloat16
            assert y.grad_fn.native.x.dtype == torch.bfloat16  # the saved activation
        else:
            assert entry.quantized.data.dtype == torch.float8_e4m3fn
            assert entry.native_forward().values.dtype == torch.bfloat16
            assert y.grad_fn.native.x.values.dtype == torch.bfloat16
        y.sum().backward()
        assert y.grad_fn.native is None  # released by the backward


def test_gemm_path_selects_and_restores():
    from megatron_calibclip.fp8.gemm import gemm_path, native_bf16_gemms, set_gemm_path

    default = "native" if native_bf16_gemms()[0] else "fp32"  # "auto"
    assert gemm_path() == default
    with using_gemm_path("exact"):
        assert gemm_path() == "exact"
    assert gemm_path() == default
    with pytest.raises(ValueError, match="not one of"):
        set_gemm_path("fast")


def _bf16_steps_beyond(got, want, k_terms, bias=None):
    """Largest |got - want| in BF16 steps of the sum's size (|want|, or |want - bias| where
    the bias cancels it), beyond fp32 accumulation noise."""
    noise = k_terms * F32_EPS * want.abs().max()
    size = want.abs() if bias is None else torch.maximum(want.abs(), (want - bias).abs())
    return (((got - want).abs() - noise).clamp(min=0) / (BF16_EPS * size).clamp(
        min=1e-30)).max().item()


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "bf16" if kw is None else "-".join(
    f"{v}" for v in kw.values()))
def test_native_path_stays_within_its_stated_bound(kw):
    """The default "native" path: every GEMM on the BF16 kernel, writing BF16 (forward,
    dgrad, wgrad); an fp32 FP8 scale multiplies the BF16 sum. Against the exact path: the
    forward output at most one BF16 step away (two roundings instead of one) on at most
    ~30% of outputs, the gradients at most one BF16 step away (their BF16 output)."""
    x, w, b, dy = _operands()
    y, dx, dw, recipe, gemm = _run(kw, "native", x, w, b, dy)
    ye, dxe, dwe, _, _ = _run(kw, "exact", x, w, b, dy)
    assert gemm.native and not gemm.exact
    # a scale applied after the BF16 sum rounds a second time (fp32 scales; powers of two
    # too when a bias follows); folded-in scales (blockwise, mxfp8) and BF16 mode round once
    rounds_twice = recipe is not None and recipe.granularity in ("tensorwise", "delayed",
                                                                 "rowwise")
    bias = b.bfloat16().float()
    assert _bf16_steps_beyond(y, ye, 320, bias) <= 1.0 + 1e-6
    differ = (y != ye).double().mean().item()
    assert differ <= (0.35 if rounds_twice else 2e-3), differ
    for got, want, k in ((dx, dxe, 200), (dw, dwe, 200)):
        assert torch.equal(got, got.bfloat16().float())  # BF16 outputs
        assert _bf16_steps_beyond(got, want, k) <= 1.0 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_codes_to_bf16_gives_the_conversion_bits_of_every_code(dtype):
    """The CPU table gather is the native GEMMs' operand conversion; it must give the bits of
    torch's own float8 -> bf16 conversion for all 256 codes (NaN, +-0, subnormals, max), in
    any contiguous shape; a non-contiguous view takes torch's conversion."""
    from megatron_calibclip.fp8.formats import codes_to_bf16

    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    assert torch.equal(codes_to_bf16(every).view(torch.int16), every.to(torch.bfloat16).view(torch.int16))
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (37, 130), generator=g, dtype=torch.uint8).view(dtype)
    for x in (codes, codes.t(), codes[:, 3:77]):
        got = codes_to_bf16(x)
        assert got.shape == x.shape and got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_auto_takes_native_only_where_bf16_gemms_are_native(monkeypatch):
    """On an AVX2-only CPU torch's BF16 GEMM is emulated (measured 8x slower than fp32 at
    SmolLM2's shapes): "auto" must not pick the BF16 kernels there."""
    from megatron_calibclip.fp8 import gemm

    for native, expected in ((True, "native"), (False, "fp32")):
        monkeypatch.setattr(gemm, "native_bf16_gemms", lambda n=native: (n, "probe"))
        assert gemm.resolve_gemm_path("auto") == (expected, f"auto: probe" + (
            "" if native else ", so fp32 GEMMs"))
        assert gemm.resolve_gemm_path("exact") == ("exact", "requested")
