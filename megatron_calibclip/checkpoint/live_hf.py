"""The live policy's weights as Hugging Face tensors, streamed in bounded buckets.

Why: a rollout engine that is not megatron (vLLM) holds its own copy of the weights under HF
names, and after every optimizer step that copy must be refreshed from the trainer's TP/PP
shards. This module is the megatron side of that refresh: it walks the declarative mapping
(mapping.py) in its fixed order (embedding, final norm, [lm_head], then layer by layer, the
order vLLM's layerwise reload wants), gathers each tensor's TP shards over the
tensor-parallel group, sends it from the pipeline stage that owns it to the other stages of
the pipeline group, splits it into HF tensors and yields them in buckets of at most
`bucket_bytes` (a single tensor larger than that is a bucket of its own). Nothing holds
more than one bucket of gathered tensors, so no rank ever builds a full extra copy of the
model (verl's `per_tensor_generator` for megatron + vLLM does the same, one tensor at a time).

Collective: every rank of the model-parallel group (TP x PP) must consume the whole stream,
in the same order. With TP = PP = 1 the yielded tensors are views of the live parameters
(no copy); the consumer must copy them before the next optimizer step.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_calibclip.checkpoint import mapping
from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.models.init import global_param_name

HFTensors = list[tuple[str, torch.Tensor]]


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from its TP shards: the inverse of models.init.shard_of (each shard
    holds its 1/world piece of each of the `stride` chunks of the full tensor)."""
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[k] for p in pieces], dim=dim) for k in range(stride)],
                     dim=dim)


def owner_stage(entry: mapping.Entry, cfg: ModelConfig, pp: int) -> int:
    """The pipeline stage whose parameters hold `entry` (the embedding: the first stage;
    the final norm and an untied output layer: the last)."""
    if entry.layer is not None:
        return entry.layer // (cfg.num_layers // pp)
    return 0 if entry.mcore == "embedding.word_embeddings.weight" else pp - 1


def _local_parameters(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters under their global checkpoint names (mapping's keys)."""
    out: dict[str, torch.nn.Parameter] = {}
    for local_name, param in model.named_parameters():
        name = mapping.local_to_checkpoint_name(global_param_name(local_name, cfg))
        out.setdefault(name, param)  # a tied output layer maps onto the embedding: keep one
    return out


def _gather_tp(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly) TP-sharded parameter, on every TP rank."""
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(tp)]
    dist.all_gather(shards, param.detach().contiguous(),
                    group=ps.get_tensor_model_parallel_group())
    return unshard(shards, param.partition_dim, getattr(param, "partition_stride", 1))


def _whole(entry: mapping.Entry, cfg: ModelConfig, params: dict[str, torch.nn.Parameter],
           dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Collective over TP (on the owner stage) and PP: `entry`'s whole megatron tensor with
    its true vocabulary rows, on every rank of the model-parallel group."""
    pp = ps.get_pipeline_model_parallel_world_size()
    owner = owner_stage(entry, cfg, pp)
    full: Optional[torch.Tensor] = None
    if ps.get_pipeline_model_parallel_rank() == owner:
        full = _gather_tp(params[entry.mcore])
        if entry.mcore in mapping.VOCAB_NAMES:
            full = full[: cfg.vocab_size]  # drop the TP padding rows
    if pp > 1:
        if full is None:
            full = torch.empty(entry.mcore_shape, dtype=dtype, device=device)
        else:
            full = full.contiguous()
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(full, src=dist.get_process_group_ranks(group)[owner], group=group)
    assert full is not None and tuple(full.shape) == tuple(entry.mcore_shape), entry.mcore
    return full


def hf_weight_buckets(model: torch.nn.Module, cfg: ModelConfig, bucket_bytes: int,
                      dtype: Optional[torch.dtype] = None) -> Iterator[HFTensors]:
    """Collective: the live weights of `model` (this rank's stage of a GPTModel built from
    `cfg`) as buckets of (HF name, tensor), every rank of the model-parallel group receiving
    the same whole tensors. dtype: cast each tensor to it (round to nearest, as the engine's
    own copy would) so that the engine receives its dtype; None: the parameters' dtype."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    params = _local_parameters(model, cfg)
    first = next(iter(params.values()))
    bucket: HFTensors = []
    size = 0
    for entry in mapping.resolve(cfg):
        full = _whole(entry, cfg, params, first.dtype, first.device)
        for name, tensor in entry.to_hf(cfg, full).items():
            if dtype is not None:
                tensor = tensor.to(dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes
    if bucket:
        yield bucket
