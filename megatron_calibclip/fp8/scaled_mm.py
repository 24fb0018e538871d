"""y = x W^T as a real FP8 GEMM (`torch._scaled_mm`), from our quantizer's codes and scales.

Why our quantizer and not torch's casts: the emulation and this backend then share every
FP8 code and scale bit for bit, so any difference between them is the GEMM alone
(accumulation order and where the scales are applied), which is what a GPU check needs to
isolate. `_scaled_mm` computes (A_codes @ B_codes) * scale_a * scale_b with fp32
accumulation; the emulation multiplies the dequantized operands, so the two agree exactly
when the scales are powers of two and to fp32 rounding otherwise.
"""
from __future__ import annotations

import torch

from megatron_calibclip.fp8.quantize import Quantized


def _codes_and_scale(q: Quantized, rows: int, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The [rows, K] FP8 codes and their dequantization multipliers as _scaled_mm takes them:
    a scalar (tensorwise, delayed) or one per row ([rows, 1], rowwise along K)."""
    codes = q.unblock(q.data).contiguous()
    if granularity in ("tensorwise", "delayed"):
        return codes, q.scale_inv.reshape(()).float()
    if granularity == "rowwise":
        return codes, q.scale_inv.reshape(rows, 1).float().contiguous()
    raise ValueError(f"torch._scaled_mm backend: {granularity!r} scaling is not supported")


def scaled_mm(x_q: Quantized, w_q: Quantized, m: int, n: int, granularity: str) -> torch.Tensor:
    """fp32 [m, n] = dequant(x_q) [m, K] @ dequant(w_q) [n, K]^T as one FP8 GEMM."""
    a, scale_a = _codes_and_scale(x_q, m, granularity)
    b, scale_b = _codes_and_scale(w_q, n, granularity)
    if scale_b.dim() == 2:
        scale_b = scale_b.t().contiguous()  # [1, n]: one multiplier per output column
    # b.t() of a row-major [n, K] tensor is the column-major [K, n] operand _scaled_mm wants
    return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
