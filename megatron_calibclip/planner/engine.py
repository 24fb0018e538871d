"""Memory of a colocated vLLM rollout engine (rollout.engine: vllm) on one GPU.

Why a share, not a sum: vLLM reserves `gpu_memory_utilization` x device memory when it
starts (weights, then the KV cache pool fills what is left of its share; its start-up check
refuses to start when that much is not free), so while it is awake the GPU holds the
trainer's resident states plus that whole share. The engine's need must fit inside the
share: its weights (the whole model, TP-sharded like the trainer, PP 1: every layer) in the
rollout dtype, and the K/V of the sequences it decodes at full length (a replica's prompts
are split over its PP engines). With sleep mode (level 1) vLLM moves its weights to host
memory and drops the KV cache after each rollout, so the share is free during log-probs and
the update; without it, the share stays resident in every phase.
"""
from __future__ import annotations

import math

from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.planner.params import stage_params
from megatron_calibclip.planner.rollout import kv_cache_bytes
from megatron_calibclip.planner.spec import GIB, Hardware, Layout, Workload

KV_BYTES = 2  # vLLM's KV cache dtype follows the model dtype (bf16)


def engine_need(m: ModelConfig, layout: Layout, w: Workload) -> tuple[float, float]:
    """(weights, KV cache) bytes of one GPU's engine shard."""
    weights = layout.engine_weight_bytes * stage_params(m, layout.tp, 1, 0).total
    sequences = math.ceil(w.rollout_batch / layout.pp)
    kv = kv_cache_bytes(m, m.num_layers, layout.tp, sequences, w.seq_len, KV_BYTES)
    return weights, kv


def engine_share(layout: Layout, hw: Hardware) -> float:
    """Bytes vLLM reserves on one GPU while it is awake."""
    return layout.engine_memory_fraction * hw.gpu_memory_gib * GIB
