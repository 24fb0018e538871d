"""What one GEMM call of an emulated linear needs besides its tensors, and its quantizers.

Why a module of its own: the autograd function (fp8/linear.py) and the native-kernel path
(fp8/linear_native.py) both read it, and neither should import the other's internals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_calibclip.fp8.delayed import AmaxHistory
from megatron_calibclip.fp8.quantize import Quantized, quantize, quantize_dequantize
from megatron_calibclip.fp8.recipe import FP8Recipe
from megatron_calibclip.fp8.weight_cache import WeightCache


@dataclass
class _Gemm:
    """What one emulated GEMM call needs besides its tensors."""

    mode: str  # "bf16" or "fp8"
    recipe: Optional[FP8Recipe]
    states: Optional[dict[str, AmaxHistory]]  # delayed scaling only
    backend: str = "emulated"  # fp8 GEMMs: "emulated" (fp32 math) or "torch" (_scaled_mm)
    weights: Optional[WeightCache] = None  # the layer's cached weight operands
    native: bool = False  # BF16 kernels on the codes (fp8/native.py) instead of fp32 GEMMs
    exact: bool = False  # native, but equal to the fp32 GEMMs up to accumulation order


def _state(gemm: _Gemm, role: str) -> Optional[AmaxHistory]:
    return gemm.states[role] if gemm.states is not None else None


def _qd(x: torch.Tensor, gemm: _Gemm, role: str, axis: int) -> torch.Tensor:
    return quantize_dequantize(x, gemm.recipe, role, axis=axis, state=_state(gemm, role))


def _q(x: torch.Tensor, gemm: _Gemm, role: str, axis: int) -> Quantized:
    return quantize(x, gemm.recipe, role, axis=axis, state=_state(gemm, role))
