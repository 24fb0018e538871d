"""The `torch` backend's FP8 GEMMs (`torch._scaled_mm`), from our quantizer's codes and scales.

Why our quantizer and not torch's casts: the emulation and this backend then share every
FP8 code and scale bit for bit, so any difference between them is the GEMM alone
(accumulation order and where the scales are applied), which is what a GPU check needs to
isolate. `_scaled_mm` computes (A_codes @ B_codes) * scale_a * scale_b with fp32
accumulation on a GPU; the emulation multiplies the dequantized operands, so the two agree
exactly when the scales are powers of two and to fp32 rounding otherwise.

Every GEMM of a linear is out[m, n] = sum_K A[m, K] B[n, K], both operands row-major with the
reduction dim K last (`Fp8Operand`): forward x [T, in] . W [out, in]; dgrad dY [T, out] .
W^T [in, out]; wgrad dY^T [out, T] . X^T [in, T]. Each operand is quantized along that GEMM's
K (TE's rowwise / columnwise copies), so rowwise scales are one per row of A ([m, 1]) and one
per row of B, i.e. per output column ([1, n]): exactly the scales `_scaled_mm` takes. No
operand of the three GEMMs needs scales along another axis, so none falls back to the
emulation. A K that is not a multiple of 16 (the wgrad's token count) is padded with zero
codes, which changes no sum and no scale, and so is an N that is not (the padded output
columns are cut off): CUDA's `_scaled_mm` needs K % 16 == 0 and both dims of mat2 divisible
by 16. Rowwise GEMMs ask for BF16 output (torch's CUTLASS rowwise kernel and ROCm's write
BF16 only), tensorwise ones fp32. tests/cuda_scaled_mm.py checks every call of the backend's
tests against CUDA's preconditions (torch's ScaledBlas.cpp).

What torch accepts (E4M3 = float8_e4m3fn, E5M2 = float8_e5m2); the E5M2 gradient is always
the first operand here:
- CPU torch 2.13 (checked): every pair (E4M3/E5M2 in either position, E5M2 x E5M2 too),
  tensorwise and rowwise scales, fp32 or bf16 output, any layout and size; 1-D rowwise
  scales are refused ("Invalid scaling configuration"), hence [m, 1] and [1, n]. Without
  AMX its kernel dequantizes (codes -> fp32 times the scales) and calls at::matmul, the
  emulation's own operations, so the two agree bit for bit; with AMX it calls oneDNN
  (E5M2 x E4M3 only with AMX-FP16).
- CUDA (torch's source, not checked on a GPU here): cuBLASLt refuses E5M2 x E5M2 (never
  asked) and takes E5M2 x E4M3 and E4M3 x E5M2; torch's CUTLASS rowwise kernel takes E5M2
  only as the first operand and outputs bf16 only, so rowwise with fp32 output needs the
  cuBLAS path (cuBLAS >= 12.9 on sm90), forward and backward alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_calibclip.fp8.quantize import Quantized

_K_MULTIPLE = 16  # cuBLASLt FP8: the reduction dim (and B's dims) must be multiples of 16


@dataclass
class Fp8Operand:
    """One GEMM operand as `_scaled_mm` reads it."""

    codes: torch.Tensor  # [lines, K] float8, row-major, K = the GEMM's reduction dim
    scale: torch.Tensor  # fp32 dequantization multipliers: () or [lines, 1] (rowwise)


def fp8_operand(q: Quantized, axis: int, granularity: str) -> Fp8Operand:
    """The 2-D tensor quantized as `q` as an operand that reduces along its `axis`: its codes
    with that dim moved last. Rowwise: `q` must have been quantized along `axis` (its scales
    are then one per line along K); ValueError otherwise (told by the block shape, so a
    square tensor's caller is trusted)."""
    codes = q.unblock(q.data)
    if codes.dim() != 2:
        raise ValueError(f"torch._scaled_mm backend: a GEMM operand is 2-D, got "
                         f"{tuple(codes.shape)}")
    codes = codes.movedim(axis, -1).contiguous()
    if granularity in ("tensorwise", "delayed"):
        return Fp8Operand(codes, q.scale_inv.reshape(()).float())
    if granularity == "rowwise":
        if tuple(q.data.shape) != tuple(codes.shape):  # rowwise blocks are [lines, K]
            other = -1 if axis in (0, -2) else 0
            raise ValueError(f"rowwise operand reducing along axis {axis} was quantized along "
                             f"axis {other}: its scales run along the wrong dim for _scaled_mm")
        return Fp8Operand(codes, q.scale_inv.reshape(-1, 1).float().contiguous())
    raise ValueError(f"torch._scaled_mm backend: {granularity!r} scaling is not supported")


def _pad(t: torch.Tensor, dim: int, value: float = 0.0) -> torch.Tensor:
    """`t` extended along `dim` to a multiple of 16 with `value` (exact: zero codes add nothing
    to a sum, a padded output line is cut off again)."""
    size = t.shape[dim]
    if size % _K_MULTIPLE == 0:
        return t
    shape = list(t.shape)
    shape[dim] = -(-size // _K_MULTIPLE) * _K_MULTIPLE - size
    fill = torch.full(shape, value, dtype=t.dtype, device=t.device) if value else \
        torch.zeros(shape, dtype=t.dtype, device=t.device)
    return torch.cat([t, fill], dim=dim)


def fp8_gemm(a: Fp8Operand, b: Fp8Operand, bias: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """[m, n] = dequant(a) [m, K] @ dequant(b) [n, K]^T (+ bias) as one FP8 GEMM, under
    CUDA's rules: K and n padded to multiples of 16 (zero codes), mat2 column-major; rowwise
    GEMMs write BF16 (CUDA's rowwise kernel; the bias, BF16, is added inside, before that
    rounding), tensorwise ones fp32 (the bias added to the fp32 sum). Returns fp32 values."""
    if a.codes.shape[1] != b.codes.shape[1]:
        raise ValueError(f"FP8 GEMM: K differs ({tuple(a.codes.shape)} vs {tuple(b.codes.shape)})")
    n = b.codes.shape[0]
    rowwise = b.scale.dim() == 2
    b_codes = _pad(b.codes.view(torch.uint8), 0).view(b.codes.dtype)  # N to 16 (cat of fp8
    # tensors is not implemented on every device: pad the bytes; a zero byte is code 0.0)
    a_codes = _pad(a.codes.view(torch.uint8), 1).view(a.codes.dtype)
    b_codes = _pad(b_codes.view(torch.uint8), 1).view(b.codes.dtype)
    scale_b = _pad(b.scale, 0, 1.0).t().contiguous() if rowwise else b.scale  # [1, n]
    fused = bias is not None and rowwise
    out = torch._scaled_mm(  # b.t() of a row-major [n, K] tensor: the column-major mat2
        a_codes, b_codes.t(), scale_a=a.scale, scale_b=scale_b,
        bias=_pad(bias.to(torch.bfloat16), 0) if fused else None,
        out_dtype=torch.bfloat16 if rowwise else torch.float32)
    out = out[:, :n].float()
    if bias is not None and not fused:
        out = out + bias.float()
    return out


def scaled_mm(x_q: Quantized, w_q: Quantized, m: int, n: int, granularity: str,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The forward GEMM: fp32 [m, n] = dequant(x_q) [m, K] @ dequant(w_q) [n, K]^T (+ bias),
    both quantized along K (their last dim)."""
    out = fp8_gemm(fp8_operand(x_q, -1, granularity), fp8_operand(w_q, -1, granularity), bias)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"FP8 GEMM: expected [{m}, {n}], got {list(out.shape)}")
    return out
