"""What the planner is asked about: the hardware, the RL workload, and one parallel layout.

Why three small dataclasses instead of a TrainConfig: the planner must answer for any GPU
count and layout before a config exists (and without importing torch), and the same inputs
come from the command line, from a recipe YAML, or from a test. Every field says what it
means and what it changes in the estimate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_calibclip.config import ConfigError

Recompute = Literal["none", "selective", "full"]
Precision = Literal["bf16", "fp8"]
GradDtype = Literal["fp32", "bf16"]
ParamsDtype = Literal["bf16", "fp32"]

GIB = 1024**3
# NVIDIA H100 SXM5 80GB as the driver reports it (nvidia-smi: 81559 MiB)
H100_80GB_GIB = 81559 / 1024


@dataclass(frozen=True)
class Hardware:
    gpu_memory_gib: float = H100_80GB_GIB  # device memory of one GPU
    gpus_per_node: int = 8  # TP stays inside a node (NVLink); PP/DP may span nodes
    # kept free for the CUDA context (~0.5 GiB), NCCL communicators and buffers (1-3 GiB)
    # and caching-allocator fragmentation; a layout fits when its peak + reserve <= memory
    reserve_gib: float = 6.0

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_memory_gib - self.reserve_gib) * GIB


@dataclass(frozen=True)
class Workload:
    seq_len: int = 4096  # prompt + response tokens of one training sequence (padded length)
    prompt_len: int = 1024  # prompt tokens (prefill length during generation)
    micro_batch: int = 1  # sequences per forward/backward in the update
    logprob_micro_batch: int = 4  # sequences per forward when computing old/ref/shadow log-probs
    # sequences one DP rank generates at once (its KV cache holds them all at full length)
    rollout_batch: int = 64
    # micro-batches per optimizer step on one DP rank; bounds the sequences in flight in the
    # 1F1B pipeline schedule (min(pp, this) on the first stage)
    microbatches_per_step: int = 8

    def __post_init__(self) -> None:
        for name in ("seq_len", "prompt_len", "micro_batch", "logprob_micro_batch",
                     "rollout_batch", "microbatches_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"plan: {name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_len > self.seq_len:
            raise ConfigError(f"plan: prompt_len ({self.prompt_len}) is longer than seq_len "
                              f"({self.seq_len})")


@dataclass(frozen=True)
class Layout:
    tp: int = 1  # tensor-parallel size (divides heads, KV groups and FFN; at most a node)
    pp: int = 1  # pipeline-parallel size (1F1B schedule, no virtual stages)
    dp: int = 1  # data-parallel size (= GPUs / (tp x pp))
    sequence_parallel: bool = True  # Megatron SP (only meaningful with tp > 1)
    distributed_optimizer: bool = True  # shard fp32 master weights + Adam states over DP
    recompute: Recompute = "none"  # activation recomputation in the update
    offload_reference: bool = False  # BF16 reference on CPU except during its log-prob pass
    precision: Precision = "fp8"  # trainer GEMMs: FP8 adds weight caches, saves FP8 inputs
    grad_dtype: GradDtype = "fp32"  # main-gradient buffer (Megatron default: fp32)
    # rollout KV cache element type: the trainer's follows the parameters (bf16, or fp32 with
    # fp32 parameters); fp8 is a what-if (megatron-core's static KV cache has no FP8 form)
    kv_cache_dtype: Literal["bf16", "fp8", "fp32"] = "bf16"
    # policy parameters (model.params_dtype): bf16 = megatron mixed precision (fp32 main params
    # in the optimizer), fp32 = the params are the masters (no separate copy)
    params_dtype: ParamsDtype = "bf16"
    reference_dtype: ParamsDtype = "bf16"  # the frozen reference model (model.reference_dtype)
    # rollout.engine: "megatron" = the policy decodes (KV cache at the trainer's TP/PP, above);
    # "vllm" = one colocated vLLM engine per TP group (planner/engine.py): its own weights
    # of the whole model at the trainer's TP in the rollout dtype, and its KV cache, inside
    # the share of the GPU vLLM reserves (rollout.vllm.gpu_memory_utilization)
    rollout_engine: Literal["megatron", "vllm"] = "megatron"
    engine_memory_fraction: float = 0.35  # vLLM's share of the device (engine: vllm)
    engine_sleeps: bool = True  # vLLM sleep mode: its memory is free outside generation
    engine_weight_bytes: float = 2.0  # per engine parameter: 2 (bf16), ~1 (fp8 rollout)
    # how a checkpoint writes the distributed optimizer (optimizer.checkpoint_format;
    # planner/save.py counts the save's host and GPU bytes)
    optimizer_format: Literal["dp_reshardable", "fully_reshardable",
                              "fully_reshardable_mem_efficient"] = "dp_reshardable"

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"plan: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs TP > 1)."""
        return self.sequence_parallel and self.tp > 1

    def describe(self) -> str:
        dist_opt = "on" if self.distributed_optimizer else "off"
        return (f"TP={self.tp} PP={self.pp} DP={self.dp}"
                f"{' SP' if self.sp else ''}, dist-opt {dist_opt}, "
                f"recompute {self.recompute}, reference "
                f"{'offloaded' if self.offload_reference else 'resident'}")
