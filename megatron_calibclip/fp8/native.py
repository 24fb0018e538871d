"""Our linears' GEMMs on native BF16 kernels (fp8/gemm.py): BF16 mode, and FP8 on the codes.

Why on the codes: every FP8 value is code x scale_inv. For one scale per tensor or per line
along K (tensorwise, delayed, rowwise) the scales factor out of the sum, so the GEMM
multiplies the codes (exact BF16 numbers, exact products) and applies scale_a x scale_b to
the fp32 sum: the order of a GPU's FP8 GEMM (cuBLASLt's alpha, TE's scale_inv pointers).
With power-of-two scales (blockwise and mxfp8 by default) code x scale_inv is itself a BF16
number, so the dequantized operands go into the BF16 kernel as they are, whatever the block
layout along K. Only blockwise / mxfp8 with fp32 scales have neither property; they keep the
fp32 emulation (`native_operand` returns None).

Every function here returns what the fp32 emulation returns up to fp32 accumulation order
(tests/fp8/test_native.py states the measured bounds); the quantizer, its codes and scales
are the same objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_calibclip.fp8.formats import codes_to_bf16
from megatron_calibclip.fp8.gemm import bf16_linear, fp32_out_mm
from megatron_calibclip.fp8.quantize import Quantized
from megatron_calibclip.fp8.recipe import FP8Recipe
from megatron_calibclip.fp8.scaled_mm import fp8_operand

BF16 = torch.bfloat16


@dataclass
class GemmOperand:
    """One operand as the native kernels read it: [lines, K] BF16 numbers (K last), and the
    multiplier of its lines applied to the sum (None when already folded into `values`)."""

    values: torch.Tensor  # bf16 [lines, K]
    scale: Optional[torch.Tensor]  # fp32 () or [lines, 1]; None: values are dequantized
    pow2: bool  # whether `scale` is a power of two (scaling after a BF16 rounding is exact)


def factors_out(recipe: FP8Recipe) -> bool:
    """One scale per tensor or per K-line: the scales can be applied after the sum."""
    return recipe.granularity in ("tensorwise", "delayed", "rowwise")


def exact_scales(recipe: FP8Recipe) -> bool:
    """Power-of-two scales (delayed scaling computes fp32 scales whatever the option)."""
    return recipe.pow2_scales and recipe.granularity != "delayed"


def supports(recipe: FP8Recipe) -> bool:
    """Whether the native kernels compute this recipe exactly (else: the fp32 emulation)."""
    return factors_out(recipe) or exact_scales(recipe)


def native_operand(q: Quantized, axis: int, recipe: FP8Recipe) -> GemmOperand:
    """`q` (the 2-D tensor quantized along `axis`) as an operand reducing along `axis`."""
    if factors_out(recipe):
        op = fp8_operand(q, axis, recipe.granularity)
        return GemmOperand(codes_to_bf16(op.codes), op.scale, exact_scales(recipe))
    if not exact_scales(recipe):
        raise ValueError(f"native FP8 GEMM: {recipe.granularity} with fp32 scales is not exact "
                         "on BF16 kernels (use the fp32 emulation)")
    values = q.dequantize(torch.float32)  # code x 2**e: a BF16 number, converted exactly
    return GemmOperand(values.movedim(axis, -1).to(BF16).contiguous(), None, True)


def _scales(a: GemmOperand, b: GemmOperand) -> Optional[torch.Tensor]:
    """alpha[m, n] = scale_a x scale_b (fp32), or None when both are folded in."""
    if a.scale is None and b.scale is None:
        return None
    sa = a.scale if a.scale is not None else torch.ones((), device=a.values.device)
    sb = b.scale if b.scale is not None else torch.ones((), device=b.values.device)
    return sa * (sb.t() if sb.dim() == 2 else sb)


def operand_gemm(a: GemmOperand, b: GemmOperand, bias: Optional[torch.Tensor] = None,
                 bf16_out: bool = True, exact: bool = False) -> torch.Tensor:
    """[m, n] = sum_K a b (x alpha) (+ bias), BF16 if `bf16_out` (one rounding, as a GPU's
    GEMM writes BF16), else fp32.

    exact: the result of the fp32 emulation up to fp32 accumulation order: the BF16 kernel
    only where its single rounding is the exact result (scales folded in, or powers of two
    applied to a bias-free sum), else the fp32-output kernel. Not exact (the "native" path):
    always the BF16 kernel, and fp32 scales multiply its BF16 sum (one more rounding: at most
    one BF16 step, on about a quarter of the outputs); an fp32 result is then BF16 values."""
    alpha = _scales(a, b)
    if alpha is None and (bf16_out or not exact):
        out = bf16_linear(a.values, b.values, bias)
        return out if bf16_out else out.float()
    if not exact or (bf16_out and bias is None and a.pow2 and b.pow2):
        out = bf16_linear(a.values, b.values).float() * alpha
        out = out if bias is None else out + bias.float()
        return out.to(BF16) if bf16_out else out.to(BF16).float()
    out = fp32_out_mm(a.values, b.values)
    if alpha is not None:
        out = out * alpha
    if bias is not None:
        out = out + bias.float()
    return out.to(BF16) if bf16_out else out

