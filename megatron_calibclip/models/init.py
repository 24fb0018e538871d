"""Layout-independent random initialisation: the same seed gives the same full weights at
any TP/PP size.

Why: megatron-core initialises from the global RNG in construction order, so a pipeline
stage that skips the embedding or the first layers, or a TP size that pads the vocabulary
differently, draws different numbers. Distributed correctness tests and reproducible demos
need identical weights across layouts, so every parameter is drawn whole from its own
generator, seeded by (seed, global parameter name), and this rank keeps its shard. The draws
are made on the host (parallel/devices.HOST) so that a GPU run gets the same weights; each
parameter's shard is then copied to the parameter's device.
Real runs load converted checkpoints instead (checkpoint/).
"""
from __future__ import annotations

import hashlib
import math

import torch
from megatron.core import parallel_state

from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.parallel.devices import HOST


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    derived = int.from_bytes(digest[:8], "little") & (2**63 - 1)
    return torch.Generator(device=HOST).manual_seed(derived)


def global_param_name(name: str, cfg: ModelConfig) -> str:
    """Local name on this PP stage -> name in the unpartitioned model (layer index offset)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        offset = parallel_state.get_pipeline_model_parallel_rank() * (cfg.num_layers // pp)
        parts[2] = str(int(parts[2]) + offset)
    if cfg.tie_embeddings and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"  # tied copy on the last stage
    return ".".join(parts)


def shard_of(full: torch.Tensor, partition_dim: int, stride: int, rank: int, world: int):
    """This rank's shard of `full`, as megatron's CPU initialisation cuts it (with stride)."""
    chunks = torch.chunk(full, stride, dim=partition_dim)
    return torch.cat([torch.chunk(c, world, dim=partition_dim)[rank] for c in chunks],
                     dim=partition_dim)


def _full_value(name: str, shape: list[int], cfg: ModelConfig, seed: int) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if "layernorm" in name or name.endswith("final_layernorm.weight") or "norm" in leaf:
        return torch.ones(shape, device=HOST)
    std = cfg.init_method_std
    if leaf == "bias":  # small but non-zero, so that bias paths are exercised by tests
        return torch.randn(shape, generator=_generator(seed, name), device=HOST) * std
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * cfg.num_layers)  # megatron's scaled output-layer init
    is_vocab = "word_embeddings" in name or name.startswith("output_layer")
    draw_shape = list(shape)
    if is_vocab:
        draw_shape[0] = cfg.vocab_size
    value = torch.randn(draw_shape, generator=_generator(seed, name), device=HOST) * std
    if is_vocab and shape[0] > cfg.vocab_size:  # TP padding rows: zero, never a real token
        value = torch.cat([value, torch.zeros(shape[0] - cfg.vocab_size, *shape[1:],
                                              device=HOST)])
    return value


@torch.no_grad()
def initialize_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Overwrite every parameter of `model` (one PP stage, TP-sharded) deterministically."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for local_name, param in model.named_parameters():
        name = global_param_name(local_name, cfg)
        shape = list(param.shape)
        sharded = getattr(param, "tensor_model_parallel", False) and tp > 1
        if sharded:
            shape[param.partition_dim] *= tp
        full = _full_value(name, shape, cfg, seed)
        if sharded:
            full = shard_of(full, param.partition_dim, getattr(param, "partition_stride", 1),
                            rank, tp)
        param.copy_(full.to(param.dtype))
