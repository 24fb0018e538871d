"""A CPU stand-in for what CUDA's `torch._scaled_mm` refuses, so that CPU tests of the torch
FP8 backend fail where a GPU would.

CPU torch runs `_scaled_mm` on any layout, size and output dtype; a GPU does not. The rules
below are read from torch's `aten/src/ATen/native/cuda/ScaledBlas.cpp` (`_scaled_mm_out_cuda`,
`get_joint_scaling`, `is_rowwise_scaling`, `is_blockwise_1x128_scaling`,
`is_blockwise_128x128_scaling`, `_scaled_rowwise_rowwise`) and `_scaled_gemm`'s layout check
("Only multiplication of row-major and column-major matrices is supported by cuBLASLt"):
- both operands 2-D FP8 (float8_e4m3fn / float8_e5m2), never E5M2 x E5M2;
- mat1 row-major [M, K], mat2 column-major [K, N];
- K % 16 == 0 (mat1's trailing dim) and both dims of mat2 divisible by 16;
- scales fp32: tensorwise one element each; rowwise scale_a [M, 1] and scale_b [1, N], both
  contiguous; blockwise 1x128 [M, ceil(K/128)] outer-dim-major and 128x128
  [ceil(K/128), ceil(N/128)] (the DeepSeek pairs, Hopper only);
- rowwise output BF16: torch's CUTLASS rowwise kernel (`f8f8bf16_rowwise`, used below cuBLAS
  12.9 or sm90) and ROCm's write BF16 (newer torch also accepts fp16/fp32 with cuBLAS >= 12.9
  on sm90; the stand-in keeps the rule every GPU accepts);
- a bias only with a BF16 (or fp16) output, and BF16 itself.
A violation raises `CudaWouldRefuse` with the rule; otherwise the wrapped kernel runs.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class CudaWouldRefuse(RuntimeError):
    """torch._scaled_mm on a CUDA device would raise for these arguments."""


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _scaling(mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor,
             scale_b: torch.Tensor) -> str:
    (m, k), n = mat1.shape, mat2.shape[1]
    fp32 = scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32
    if not fp32:
        raise CudaWouldRefuse(f"scales must be fp32, got {scale_a.dtype} and {scale_b.dtype}")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    if (tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
            and scale_a.is_contiguous() and scale_b.is_contiguous()):
        return "rowwise"
    blocks_a = tuple(scale_a.shape) == (m, _ceil(k, 128)) and (m == 1 or scale_a.stride(0) == 1)
    blocks_b = tuple(scale_b.shape) == (_ceil(k, 128), _ceil(n, 128))
    if blocks_a and blocks_b:
        return "blockwise"
    raise CudaWouldRefuse(
        f"Invalid scaling configuration: scale_a {tuple(scale_a.shape)} stride "
        f"{scale_a.stride()}, scale_b {tuple(scale_b.shape)} for mat1 {tuple(mat1.shape)}, "
        f"mat2 {tuple(mat2.shape)}")


def check(mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
          bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> str:
    """The scaling type CUDA would pick, or CudaWouldRefuse with the rule broken."""
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.shape[1] != mat2.shape[0]:
        raise CudaWouldRefuse(f"mat1 {tuple(mat1.shape)} and mat2 {tuple(mat2.shape)} "
                              "cannot be multiplied")
    if mat1.dtype not in FP8 or mat2.dtype not in FP8:
        raise CudaWouldRefuse(f"Expected Float8 matrices, got {mat1.dtype} and {mat2.dtype}")
    if mat1.dtype == mat2.dtype == torch.float8_e5m2:
        raise CudaWouldRefuse("Multiplication of two Float8_e5m2 matrices is not supported")
    if mat1.shape[1] % 16:
        raise CudaWouldRefuse(f"Expected trailing dimension of mat1 to be divisible by 16 but "
                              f"got mat1 shape: {tuple(mat1.shape)}")
    if mat2.shape[0] % 16 or mat2.shape[1] % 16:
        raise CudaWouldRefuse(f"mat2 shape {tuple(mat2.shape)} must be divisible by 16")
    if mat1.stride(1) != 1 or mat2.stride(0) != 1:
        raise CudaWouldRefuse("Only multiplication of row-major and column-major matrices is "
                              f"supported by cuBLASLt (strides {mat1.stride()}, {mat2.stride()})")
    scaling = _scaling(mat1, mat2, scale_a, scale_b)
    out = out_dtype or mat1.dtype
    if scaling in ("rowwise", "blockwise") and out != torch.bfloat16:
        raise CudaWouldRefuse(f"{scaling} _scaled_mm: BF16 output only on every GPU, got {out}")
    if bias is not None and (out == torch.float32 or bias.dtype != torch.bfloat16):
        raise CudaWouldRefuse(f"Bias needs a BF16 output and a BF16 bias (out {out}, bias "
                              f"{bias.dtype})")
    return scaling


def cuda_rules(kernel: Callable) -> Callable:
    """`kernel` (a _scaled_mm) behind CUDA's preconditions; records each call's scaling."""

    def checked(mat1, mat2, scale_a=None, scale_b=None, bias=None, scale_result=None,
                out_dtype=None, use_fast_accum=False):
        checked.calls.append(check(mat1, mat2, scale_a, scale_b, bias, out_dtype))
        return kernel(mat1, mat2, scale_a=scale_a, scale_b=scale_b, bias=bias,
                      out_dtype=out_dtype)

    checked.calls = []
    return checked


@contextlib.contextmanager
def cuda_scaled_mm_rules() -> Iterator[Callable]:
    """Every torch._scaled_mm call in the block goes through `check` first."""
    real = torch._scaled_mm
    torch._scaled_mm = cuda_rules(real)
    try:
        yield torch._scaled_mm
    finally:
        torch._scaled_mm = real
