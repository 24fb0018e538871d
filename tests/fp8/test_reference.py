"""quantize_dequantize equals an independent reference bit for bit.

The reference below shares no code with megatron_calibclip.fp8: element rounding is done in
numpy float64 from the format's definition (sign, exponent clamped at the format's smallest
normal exponent, `mbits` mantissa bits, round half to even with np.rint, saturation at the
largest finite value), scales follow Transformer Engine's documented formulas computed in
numpy float32, and block layouts are cut with plain Python index loops. Results are
compared as float32 bit patterns (so -0.0 vs 0.0 or a last-bit scale difference fails).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from megatron_calibclip.fp8 import E4M3, E5M2, AmaxHistory, FP8Recipe, quantize, quantize_dequantize
from megatron_calibclip.fp8.formats import round_to_fp8

# name: (mantissa bits, smallest normal exponent, largest finite value)
FMT = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}
F32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------- the reference
def ref_round(v: np.ndarray, fmt: str) -> np.ndarray:
    """float32 values -> nearest FP8 value (RNE, saturating), as float32."""
    mbits, emin, vmax = FMT[fmt]
    a = np.abs(v.astype(np.float64))
    _, k = np.frexp(a)  # a = m * 2**k with m in [0.5, 1): floor(log2 a) = k - 1
    quantum = np.ldexp(1.0, np.maximum(k - 1, emin) - mbits)  # grid spacing at a
    q = np.minimum(np.rint(a / quantum) * quantum, vmax)  # a / quantum is exact (power of 2)
    return np.copysign(q, v).astype(np.float32)


def ref_current_scale(amax: float, fmt: str, pow2: bool) -> np.float32:
    vmax = FMT[fmt][2]
    if amax == 0.0:
        return F32(1.0)
    with np.errstate(over="ignore"):
        s = F32(vmax) / F32(amax)
    if np.isinf(s):
        s = F32(FLT_MAX)
    if pow2:  # keep the exponent: the largest power of two <= s
        _, k = np.frexp(float(s))
        s = F32(2.0 ** (k - 1))
    return s


def ref_e8m0(amax: float, fmt: str) -> int:
    """Biased exponent e with 2**(e-127) the smallest power of two >= amax / max (clamped)."""
    v = float(F32(amax) * F32(1.0 / FMT[fmt][2]))
    if v <= 2.0 ** -127:
        return 0
    m, k = np.frexp(v)
    e = (k - 1 if m == 0.5 else k) + 127
    return min(e, 254)


def ref_block(block: np.ndarray, fmt: str, granularity: str, pow2: bool,
              delayed_scale: float | None = None) -> np.ndarray:
    """One scaling group, quantized and dequantized."""
    amax = float(np.max(np.abs(block))) if block.size else 0.0
    if granularity == "mxfp8":
        e = ref_e8m0(amax, fmt)
        scale = F32(1.0) if e == 0 else F32(2.0 ** (127 - e))
        scale_inv = F32(2.0 ** (e - 127))
    else:
        scale = F32(delayed_scale) if delayed_scale is not None else \
            ref_current_scale(amax, fmt, pow2)
        scale_inv = F32(1.0) / scale
    with np.errstate(over="ignore"):
        scaled = block.astype(np.float32) * scale  # fp32 multiply, as the kernels
    return (ref_round(scaled, fmt) * scale_inv).astype(np.float32)


def ref_quantize_dequantize(x: np.ndarray, fmt: str, granularity: str, role: str, axis: int,
                            pow2: bool, delayed_scale: float | None = None) -> np.ndarray:
    out = np.empty_like(x, dtype=np.float32)
    if granularity in ("tensorwise", "delayed"):
        out[...] = ref_block(x, fmt, granularity, pow2, delayed_scale)
        return out
    if granularity == "blockwise" and role == "weight":
        m, n = x.shape
        for i in range(0, m, 128):
            for j in range(0, n, 128):
                out[i:i + 128, j:j + 128] = ref_block(x[i:i + 128, j:j + 128], fmt,
                                                      granularity, pow2)
        return out
    size = {"rowwise": x.shape[axis], "blockwise": 128, "mxfp8": 32}[granularity]
    xt, ot = np.moveaxis(x, axis, -1), np.moveaxis(out, axis, -1)  # views
    n = xt.shape[-1]
    for idx in itertools.product(*(range(d) for d in xt.shape[:-1])):
        for j in range(0, n, max(size, 1)):
            ot[idx + (slice(j, j + size),)] = ref_block(xt[idx + (slice(j, j + size),)], fmt,
                                                        granularity, pow2)
    return out


# ---------------------------------------------------------------- inputs
def _bits(t) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _grid(fmt: str) -> np.ndarray:
    """Every non-negative finite value of the format (from its definition)."""
    mbits, emin, vmax = FMT[fmt]
    vals = {i * 2.0 ** (emin - mbits) for i in range(2 ** mbits)}  # zero + subnormals
    e = emin
    while True:
        for i in range(2 ** mbits):
            v = (1 + i / 2 ** mbits) * 2.0 ** e
            if v <= vmax:
                vals.add(v)
        if 2.0 ** e > vmax:
            break
        e += 1
    return np.array(sorted(vals))


def _element_cases(fmt: str) -> np.ndarray:
    g = _grid(fmt)
    mid = (g[1:] + g[:-1]) / 2  # exact ties (RNE decides)
    mid32 = mid.astype(np.float32)
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(4000) * np.exp2(rng.uniform(-30, 20, 4000))).astype(np.float32)
    beyond = np.array([g[-1] * 1.01, g[-1] + 0.4 * (g[-1] - g[-2]), 1e6, 1e30, FLT_MAX],
                      dtype=np.float32)
    fp32_sub = np.array([1e-40, 1.4e-45, 1e-39, 2.0 ** -126], dtype=np.float32)
    vals = np.concatenate([g, mid32, np.nextafter(mid32, np.float32(np.inf)),
                           np.nextafter(mid32, np.float32(0)), rand, beyond, fp32_sub,
                           np.zeros(1, np.float32)]).astype(np.float32)
    return np.concatenate([vals, -vals])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_element_rounding_bit_exact(fmt):
    """Every grid point, every midpoint (+-1 ulp), random magnitudes over 50 binades, fp32
    subnormals and values beyond the format's max, both signs."""
    x = _element_cases(fmt)
    assert len(_grid(fmt)) == {"e4m3": 127, "e5m2": 124}[fmt]  # finite non-negative values
    got = round_to_fp8(torch.from_numpy(x), E4M3 if fmt == "e4m3" else E5M2)
    want = ref_round(x, fmt)
    bad = np.nonzero(_bits(got) != _bits(want))[0]
    assert bad.size == 0, [(float(x[i]), float(got[i]), float(want[i])) for i in bad[:5]]


def _tensor(shape, seed: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.uniform(-8, 8, shape))).astype(np.float32)
    flat = x.reshape(-1)
    if kind == "zeros_subnormal":
        flat[rng.random(flat.size) < 0.2] = 0.0
        flat[rng.random(flat.size) < 0.05] = np.float32(3e-41)  # fp32 subnormals
        flat[: max(1, flat.size // 50)] *= np.float32(1e-6)  # land in the FP8 subnormals
    elif kind == "outlier":
        flat[rng.integers(0, flat.size, 3)] = np.float32(1e5)  # far beyond 448 before scaling
    elif kind == "zero_block":
        x.reshape(-1, x.shape[-1])[0] = 0.0  # a whole row
        if x.shape[-1] >= 128:
            x[..., :128] = 0.0  # a whole 1x128 tile (and a 128x128 weight block's rows)
        if x.ndim == 2 and x.shape[0] >= 128 and x.shape[1] >= 128:
            x[:128, :128] = 0.0
    elif kind == "all_zero":
        x[...] = 0.0
    elif kind == "tiny":  # the whole tensor is fp32-subnormal: the scale overflows to FLT_MAX
        x[...] = np.float32(2e-39) * np.sign(x)
    return x


SHAPES = [(1,), (7,), (1, 1), (5, 7), (3, 33), (4, 128), (2, 300), (130, 70), (129, 257),
          (2, 3, 160)]
KINDS = ["normal", "zeros_subnormal", "outlier", "zero_block", "all_zero", "tiny"]
RECIPES = [
    ("e4m3", "tensorwise", None), ("e4m3", "tensorwise", True), ("e4m3", "rowwise", None),
    ("e4m3", "blockwise", None), ("e4m3", "blockwise", False), ("e4m3", "mxfp8", None),
]


E5M2_RECIPES = [("e5m2", g, p) for _, g, p in RECIPES]


@pytest.mark.parametrize("fmt, granularity, pow2", RECIPES + E5M2_RECIPES)
def test_quantize_dequantize_bit_exact(fmt, granularity, pow2):
    recipe = FP8Recipe(format="hybrid", granularity=granularity, power_of_two_scales=pow2)
    role_fwd = "grad" if fmt == "e5m2" else "activation"
    checked = 0
    for (si, shape), kind in itertools.product(enumerate(SHAPES), KINDS):
        x = _tensor(shape, seed=100 * si + KINDS.index(kind), kind=kind)
        roles = [role_fwd] + (["weight"] if fmt == "e4m3" and len(shape) == 2 else [])
        for role in roles:
            for axis in ([-1, 0] if len(shape) > 1 else [-1]):
                got = quantize_dequantize(torch.from_numpy(x.copy()), recipe, role, axis=axis)
                want = ref_quantize_dequantize(x, fmt, granularity, role, axis if axis >= 0
                                               else x.ndim - 1, recipe.pow2_scales)
                mism = _bits(got) != _bits(want)
                assert not mism.any(), (
                    f"{kind} {shape} {role} axis={axis}: {mism.sum()} mismatches, e.g. "
                    f"x={x[mism][:3]} got={got.numpy()[mism][:3]} want={want[mism][:3]}")
                assert np.isfinite(want).all()
                checked += got.numel()
    assert checked > 100_000


def test_delayed_stale_scale_saturates_bit_exact():
    """Delayed scaling with a stale scale drives values beyond the format's max."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 50)) * 10).astype(np.float32)
    x[0, 0], x[1, 1] = 1e4, -3e5
    for fmt, role in (("e4m3", "activation"), ("e5m2", "grad")):
        state = AmaxHistory(E4M3 if fmt == "e4m3" else E5M2, 4, "max", 0)
        state.record(torch.tensor(0.7))  # next scale max / 0.7: most of x saturates
        scale = float(state.scale)
        recipe = FP8Recipe(format="hybrid", granularity="delayed")
        got = quantize_dequantize(torch.from_numpy(x), recipe, role, state=state)
        want = ref_quantize_dequantize(x, fmt, "delayed", role, 1, False, delayed_scale=scale)
        assert (_bits(got) == _bits(want)).all()
        assert float(np.abs(want).max()) == pytest.approx(0.7, rel=1e-6)  # saturated at max


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("granularity", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
def test_non_finite_input_raises(bad, granularity):
    from megatron_calibclip.fp8 import NonFiniteError

    recipe = FP8Recipe(granularity=granularity)
    x = torch.randn(4, 40)
    x[2, 17] = bad
    state = AmaxHistory(E4M3, 4, "max", 0) if granularity == "delayed" else None
    with pytest.raises(NonFiniteError, match=r"activation .*\[4, 40\].* 1 non-finite"):
        quantize_dequantize(x, recipe, "activation", state=state)
    if state is not None:
        assert state.updates == 0  # a rejected tensor does not enter the amax history


@pytest.mark.parametrize("granularity", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("role", ["activation", "weight", "grad"])
def test_quantize_never_reads_an_accelerator_tensor_on_the_host(granularity, role):
    """On a GPU a host read in the quantizer (the finiteness check was `bool(isfinite(amax)
    .all())`) stalls every operand of every GEMM, every decode step. The meta device stands
    in: any host read of a meta tensor raises. The check is a device-side assert there."""
    recipe = FP8Recipe(granularity=granularity)
    x = torch.randn(4, 256, device="meta")
    state = AmaxHistory(E4M3, 4, "max", 0) if granularity == "delayed" else None
    q = quantize(x, recipe, role, state=state)
    assert q.data.device.type == "meta"
    if state is not None:
        assert state.updates == 1 and state.scale.device.type == "meta"
