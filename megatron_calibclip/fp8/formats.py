"""The two FP8 element formats and the one rounding step every emulated GEMM shares.

Why a module of its own: the cast is where emulation most easily goes wrong on CPU. torch's
float8 casts round to nearest-even, but on this CPU e4m3fn saturates at +-448 while e5m2
overflows to inf, and GPUs cast with `satfinite` (saturate both). So every cast here clamps
to the format's largest finite value first, making both formats behave like the hardware.
Elementwise fp8 arithmetic is not implemented in CPU torch, so values live in fp32 and pass
through a float8 dtype only to be rounded.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FP8Format:
    """One FP8 element format (OCP FP8: E4M3 without infinities, E5M2 IEEE-like)."""

    name: str  # "e4m3" or "e5m2"
    dtype: torch.dtype  # torch storage dtype used for the round trip
    max: float  # largest finite value (448 for e4m3, 57344 for e5m2)
    emax: int  # exponent of `max` (8 for e4m3, 15 for e5m2); MX scales need it


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0, 8)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0, 15)
FORMATS: dict[str, FP8Format] = {"e4m3": E4M3, "e5m2": E5M2}


def cast_to_fp8(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Round fp32 values (already multiplied by their scale) to `fmt`; returns float8 data.

    Saturating like the GPU's `cvt.rn.satfinite`: |x| > max becomes +-max, NaN stays NaN.
    """
    return x.float().clamp(-fmt.max, fmt.max).to(fmt.dtype)


def round_to_fp8(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """fp32 -> nearest `fmt` value (RNE, saturating) -> fp32."""
    return cast_to_fp8(x, fmt).float()


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest bf16 (RNE) -> fp32: what a BF16 tensor-core operand or output holds."""
    return x.to(torch.bfloat16).float()


def to_bf16_values(x: torch.Tensor) -> torch.Tensor:
    """The nearest bf16 values in x's own dtype (a bf16 or integer tensor is returned as is):
    a bf16 stack's tensor, held in an fp32 emulation."""
    if x.dtype == torch.bfloat16 or not x.is_floating_point():
        return x
    return x.to(torch.bfloat16).to(x.dtype)


_BF16_OF_CODE: dict[torch.dtype, torch.Tensor] = {}  # float8 dtype -> its 256 values in BF16


def codes_to_bf16(codes: torch.Tensor) -> torch.Tensor:
    """FP8 codes as the same numbers in BF16 (exact: every E4M3 / E5M2 value, NaN included, is
    a BF16 number). This is the operand conversion of every native FP8 GEMM.

    Why a table on the CPU: CPU torch converts out of float8 one element at a time (6.8 ms for
    1.2M elements on this machine); a gather from the 256 values of the format
    (`index_select`) gives the same bits in 1.0 ms. Elsewhere (a GPU's conversion is a fused
    kernel) and for non-contiguous codes: `.to(torch.bfloat16)`."""
    if codes.device.type != "cpu" or not codes.is_contiguous() or codes.dtype not in (
            torch.float8_e4m3fn, torch.float8_e5m2):
        return codes.to(torch.bfloat16)
    table = _BF16_OF_CODE.get(codes.dtype)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device=codes.device).view(codes.dtype).to(torch.bfloat16)
        _BF16_OF_CODE[codes.dtype] = table
    flat = codes.view(torch.uint8).reshape(-1).to(torch.int32)
    return table.index_select(0, flat).view(codes.shape)
