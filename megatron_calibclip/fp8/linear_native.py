"""Forward and backward of an emulated linear on the native BF16 kernels (fp8/native.py).

Same quantizer calls, in the same order, as the fp32 emulation in fp8/linear.py (so delayed
scaling histories advance identically); only the GEMMs differ: BF16 operands (the bf16
copy, or the FP8 codes), fp32 accumulation, scales after the sum. Saved activations are
BF16 (2 bytes), not fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron_calibclip.fp8.gemm import bf16_linear, fp32_out_mm
from megatron_calibclip.fp8.linear_gemm import _Gemm, _q, _state
from megatron_calibclip.fp8.native import BF16, GemmOperand, native_operand, operand_gemm
from megatron_calibclip.fp8.quantize import quantize, same_both_ways


@dataclass
class NativeSaved:
    """What the backward reads: the wgrad's input operand and the dgrad's weight operand."""

    x: Optional[Union[torch.Tensor, GemmOperand]]  # bf16 [T, in], or FP8 operand [in, T]
    w: Optional[Union[torch.Tensor, GemmOperand]]  # bf16 [out, in], or FP8 operand [in, out]


def native_forward(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   gemm: _Gemm, need_dgrad: bool, need_wgrad: bool, bf16_io: bool
                   ) -> tuple[torch.Tensor, NativeSaved]:
    """y [T, out] = x2 [T, in] W^T (+ bias): BF16 when `bf16_io`, else fp32."""
    if gemm.mode == "bf16":
        xb = x2.to(BF16)
        wb = gemm.weights.operands(weight, None).bf16_copy
        out = bf16_linear(xb, wb, bias)
        return out, NativeSaved(xb if need_wgrad else None, wb if need_dgrad else None)
    recipe = gemm.recipe
    qx = _q(x2, gemm, "activation", -1)
    ops = gemm.weights.operands(weight, recipe, _state(gemm, "weight"))
    xa = native_operand(qx, -1, recipe)
    out = operand_gemm(xa, ops.native_forward(), bias, bf16_io, gemm.exact)
    x_saved = None
    if need_wgrad and recipe.fp8_wgrad:  # the input quantized along tokens (wgrad's K)
        x_saved = _along_tokens(x2, qx, xa, recipe, "activation")
    elif need_wgrad:
        x_saved = x2.to(BF16)  # a BF16 wgrad
    return out, NativeSaved(x_saved, ops.native_dgrad() if need_dgrad else None)


def native_backward(g2: torch.Tensor, gemm: _Gemm, saved: NativeSaved, need_dgrad: bool,
                    need_wgrad: bool) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(dgrad, wgrad) as fp32 tensors. Exact path: as the fp32 emulation (dgrad BF16 values
    in bf16 mode, fp32 in fp8 mode; wgrad fp32, a fused fp32 main_grad accumulation).
    Native path: every GEMM writes BF16, as TE's dgrad and a wgrad without
    gradient-accumulation fusion (then added to the fp32 main_grad)."""
    grad_x = grad_w = None
    if gemm.mode == "bf16":
        gb = g2.to(BF16)
        if need_dgrad:
            grad_x = torch.matmul(gb, saved.w).float()
        if need_wgrad:
            grad_w = _wgrad_bf16(gb, saved.x, gemm.exact)
        return grad_x, grad_w
    recipe = gemm.recipe
    qg = _q(g2, gemm, "grad", -1)  # the one (delayed) update of the grad amax
    ga = native_operand(qg, -1, recipe)
    if need_dgrad:
        grad_x = operand_gemm(ga, saved.w, bf16_out=False, exact=gemm.exact)
    if need_wgrad and recipe.fp8_wgrad:
        grad_w = operand_gemm(_along_tokens(g2, qg, ga, recipe, "grad"), saved.x,
                              bf16_out=False, exact=gemm.exact)
    elif need_wgrad:
        grad_w = _wgrad_bf16(g2.to(BF16), saved.x, gemm.exact)
    return grad_x, grad_w


def _along_tokens(t: torch.Tensor, q, op: GemmOperand, recipe, role: str) -> GemmOperand:
    """`t` as the wgrad reads it, quantized along the tokens. With one scale per tensor the
    codes are the forward's: the same BF16 operand, transposed (no second conversion)."""
    if same_both_ways(recipe, role):
        return GemmOperand(op.values.t(), op.scale, op.pow2)
    return native_operand(quantize(t, recipe, role, axis=0), 0, recipe)


def _wgrad_bf16(gb: torch.Tensor, xb: torch.Tensor, exact: bool) -> torch.Tensor:
    """A BF16 weight-gradient GEMM dY^T X: fp32 output (exact) or BF16 output."""
    if exact:
        return fp32_out_mm(gb.t(), xb.t())
    return torch.matmul(gb.t(), xb).float()
