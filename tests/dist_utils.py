"""Helpers for distributed test bodies: unshard TP tensors, name parameters globally.

Only for tests: they gather whole parameters/gradients so that a sharded run can be compared
with a single-process reference parameter by parameter.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state


def gather_tp(tensor: torch.Tensor, partition_dim: int, stride: int = 1) -> torch.Tensor:
    """Reassemble a TP-sharded tensor as megatron's CPU initialisation laid it out.

    With stride s each shard is s chunks along `partition_dim`, chunk j of rank r being block
    (j, r) of the full tensor (SwiGLU fc1 stores [gate_r; up_r] on rank r).
    """
    group = parallel_state.get_tensor_model_parallel_group()
    world = dist.get_world_size(group)
    if world == 1:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    if stride == 1:
        return torch.cat(shards, dim=partition_dim)
    chunks = [torch.chunk(s, stride, dim=partition_dim) for s in shards]
    return torch.cat([chunks[r][j] for j in range(stride) for r in range(world)], partition_dim)


def full_parameter(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Unshard `value` (the param itself or its grad) using the param's TP attributes."""
    if getattr(param, "tensor_model_parallel", False):
        return gather_tp(value, param.partition_dim, getattr(param, "partition_stride", 1))
    return value.detach().clone()


def global_name(name: str, layers_per_stage: int) -> str:
    """'decoder.layers.{local}.x' -> 'decoder.layers.{global}.x' for this PP stage."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        offset = parallel_state.get_pipeline_model_parallel_rank() * layers_per_stage
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def full_state(model: torch.nn.Module, num_layers: int, vocab_size: int, grads: bool) -> dict:
    """{global name: numpy array} of whole parameters (or their grads) on this stage.

    The padded vocabulary rows are cut to `vocab_size`. Every TP rank returns the same dict.
    Grads are read from `main_grad` (megatron DDP) when present, else `.grad`.
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        if grads:
            value = getattr(p, "main_grad", None)
            if value is None:
                value = p.grad
            if value is None:
                value = torch.zeros_like(p)
        else:
            value = p
        full = full_parameter(p, value.float())
        if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
            full = full[:vocab_size]
        out[global_name(name, num_layers // pp)] = full.numpy()
    return out


def gather_vocab(logits: torch.Tensor, vocab_size: int) -> np.ndarray:
    """TP-sharded logits [..., V/tp] -> full [..., vocab_size] numpy array."""
    return gather_tp(logits.float(), logits.dim() - 1)[..., :vocab_size].numpy()
