"""Bytes of the model states one GPU keeps for the whole run: weights, gradients, optimizer.

Why these byte counts (Megatron mixed precision with BF16 parameters, the layout our trainer
uses on GPUs, `model.params_dtype: bf16`): BF16 weights 2 B/param; the main-gradient buffer
4 B/param in FP32 (2 with BF16 gradient reduction); FP32 master weights + Adam m + v
12 B/param, divided by DP when the distributed optimizer shards them (gradients and BF16
weights are not sharded). That is Megatron's "18 bytes, or 6 + 12/d with the distributed
optimizer" per parameter, and ZeRO's 2 + 2 + 12 with 16-bit gradients. With FP32 parameters
(`params_dtype: fp32`, the CPU emulation's flow) the weights are 4 B and are themselves the
masters: the optimizer keeps Adam m + v only (8 B). Transformer Engine FP8 GEMMs add, per
linear weight, an FP8 copy (1 B) and on Hopper its FP8 transpose for the backward GEMMs
(1 B), kept between forward and backward. The frozen reference model has weights only, in
its own dtype. tests/planner/test_planner_matches_trainer.py compares these counts with the
bytes the trainer allocates.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_calibclip.planner.params import StageParams
from megatron_calibclip.planner.spec import Layout

DTYPE_BYTES = {"bf16": 2, "fp32": 4, "fp8": 1}
WEIGHT_BYTES = 2  # BF16 model weights
MASTER_AND_ADAM_BYTES = 12  # FP32 master weight + Adam first and second moments
ADAM_BYTES = 8  # Adam first and second moments (FP32 parameters are their own masters)
FP8_CACHE_BYTES = 2  # FP8 weight copy + FP8 transpose, per linear-weight parameter


@dataclass(frozen=True)
class ModelStates:
    weights: float  # policy weights (bf16, or fp32 with fp32 parameters)
    fp8_caches: float  # FP8 copies and transposes of the linear weights
    grads: float  # main-gradient buffer
    optimizer: float  # FP32 master weights (bf16 params only) + Adam states (this rank's shard)
    reference: float  # reference weights while resident on the GPU

    @property
    def policy(self) -> float:
        return self.weights + self.fp8_caches + self.grads + self.optimizer


def grad_bytes(layout: Layout) -> int:
    return 4 if layout.grad_dtype == "fp32" else 2


def weight_bytes(layout: Layout) -> int:
    return DTYPE_BYTES[layout.params_dtype]


def optimizer_bytes_per_param(layout: Layout) -> float:
    states = MASTER_AND_ADAM_BYTES if layout.params_dtype == "bf16" else ADAM_BYTES
    return states / (layout.dp if layout.distributed_optimizer else 1)


def bytes_per_param(layout: Layout) -> float:
    """Weights + gradients + optimizer per parameter (Megatron's 18 or 6 + 12/d)."""
    return weight_bytes(layout) + grad_bytes(layout) + optimizer_bytes_per_param(layout)


def model_states(stage: StageParams, layout: Layout, *, reference_resident: bool) -> ModelStates:
    n = stage.total
    return ModelStates(
        weights=weight_bytes(layout) * n,
        fp8_caches=FP8_CACHE_BYTES * stage.linear if layout.precision == "fp8" else 0.0,
        grads=grad_bytes(layout) * n,
        optimizer=optimizer_bytes_per_param(layout) * n,
        reference=DTYPE_BYTES[layout.reference_dtype] * n if reference_resident else 0.0,
    )
