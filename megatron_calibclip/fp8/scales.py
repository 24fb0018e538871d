"""How a scale is chosen from an amax, exactly as Transformer Engine's kernels choose it.

Why bit-exact formulas: the noise this project studies is made of individual rounding
decisions; a scale that differs in the last bit moves values across grid points. All
arithmetic is fp32, like the kernels.

Convention (TE's): `scale` multiplies the high-precision value before the cast to FP8,
`scale_inv` multiplies the FP8 value to dequantize it.
"""
from __future__ import annotations

import torch

from megatron_calibclip.fp8.formats import FP8Format

FP32_MAX = torch.finfo(torch.float32).max


def current_scale(amax: torch.Tensor, fmt: FP8Format, pow2: bool) -> torch.Tensor:
    """TE `compute_scale_from_amax` (current scaling, per tensor / row / block).

    scale = fp8_max / amax in fp32; amax == 0, inf or NaN -> scale 1 (so an all-zero block
    quantizes to zeros, not NaN); an fp32-overflowing scale -> FLT_MAX; pow2 keeps only the
    exponent bits (rounds the scale down to a power of two, so x * scale never exceeds max).
    """
    amax = amax.float()
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    safe = torch.where(bad, torch.ones_like(amax), amax)
    scale = torch.full_like(amax, fmt.max) / safe
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if pow2:
        bits = scale.view(torch.int32) & -0x800000  # 0xFF800000: sign + exponent bits
        scale = bits.view(torch.float32)
    return scale


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """scale_inv = 1 / scale in fp32 (TE computes the inverse once and stores it)."""
    return torch.ones_like(scale) / scale


def delayed_scale(
    amax: torch.Tensor, previous: torch.Tensor, fmt: FP8Format, margin: int
) -> torch.Tensor:
    """TE `_default_sf_compute` (DelayedScaling): (fp8_max / amax) / 2**margin.

    amax <= 0 or non-finite keeps the previous scale; an infinite scale becomes FLT_MAX.
    """
    amax = amax.float()
    sf = (torch.full_like(amax, fmt.max) / amax) / (2.0 ** margin)
    sf = torch.where(amax > 0.0, sf, previous)
    sf = torch.where(torch.isfinite(amax), sf, previous)
    return torch.where(torch.isinf(sf), torch.full_like(sf, FP32_MAX), sf)


def e8m0_exponent(amax: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Biased E8M0 exponent of an MXFP8 block scale, as TE's `float_to_e8m0`.

    TE computes v = amax * (1 / fp8_max) in fp32 and rounds the exponent of v *up*
    (PTX cvt.rp), so that amax / 2**(e - 127) <= fp8_max: no element saturates. v == 0
    and fp32 subnormals v <= 2**-127 give 0; the result is clamped to [0, 254] (satfinite).
    Returns int32 in [0, 254]; 255 (NaN) for a NaN amax.
    """
    rcp = torch.tensor(1.0 / fmt.max, dtype=torch.float32, device=amax.device)
    v = amax.float() * rcp
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + round_up.to(torch.int32)
    exponent = torch.where(torch.isinf(v), torch.full_like(exponent, 0xFE), exponent)
    return torch.where(torch.isnan(v), torch.full_like(exponent, 0xFF), exponent)


def e8m0_scale_inv(exponent: torch.Tensor) -> torch.Tensor:
    """Dequantization multiplier 2**(e - 127) (exactly representable in fp32 for e >= 1)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 127)


def e8m0_scale(exponent: torch.Tensor) -> torch.Tensor:
    """Quantization multiplier, TE `exp2f_rcp`: 2**(127 - e), and 1 for e == 0."""
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), 127 - exponent)
    return torch.where(exponent == 0, torch.ones_like(scale), scale)
