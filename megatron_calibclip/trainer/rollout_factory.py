"""The rollout engine a TrainConfig asks for (`rollout.engine`), composed from the policy.

Why in trainer/: the vLLM engine (rollout/, floor 2) needs the HF config and the live HF
weight stream, which come from checkpoint/ (floor 3); only the trainer composes the floors.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_calibclip.checkpoint import mapping
from megatron_calibclip.checkpoint.hf_config import hf_config_from_model_config
from megatron_calibclip.checkpoint.live_hf import hf_weight_buckets
from megatron_calibclip.fp8 import precision
from megatron_calibclip.models import ModelConfig
from megatron_calibclip.parallel.devices import model_device
from megatron_calibclip.rollout import MegatronRolloutEngine, RolloutEngine
from megatron_calibclip.trainer.config import TrainConfig


def vllm_max_model_len(cfg: TrainConfig, model_cfg: ModelConfig) -> int:
    """The longest sequence the engine must serve: the longest prompt plus the longest
    response of training and evaluation (rollout.vllm.max_model_len overrides)."""
    if cfg.rollout.vllm.max_model_len is not None:
        return cfg.rollout.vllm.max_model_len
    response = max(cfg.rollout.sampling.max_new_tokens, cfg.evaluation.max_new_tokens or 0)
    return min(cfg.data.max_prompt_tokens + response, model_cfg.max_position_embeddings)


def hf_tensor_count(model_cfg: ModelConfig) -> int:
    """How many HF tensors a full weight sync carries."""
    return sum(len(e.hf) for e in mapping.resolve(model_cfg))


def build_rollout_engine(cfg: TrainConfig, model_cfg: ModelConfig, policy: torch.nn.Module,
                         tokenizer: Any) -> RolloutEngine:
    """`rollout.engine`: megatron (the policy's own decode loop in the rollout precision) or
    vLLM colocated in this process (collective: every rank builds its engine together)."""
    if cfg.rollout.engine == "megatron":
        recipe = cfg.rollout_recipe
        return MegatronRolloutEngine(
            policy, model_cfg.vocab_size, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
            stop_ids=getattr(tokenizer, "stop_ids", ()),
            precision=lambda: precision(policy, cfg.rollout.precision, recipe, batch_amax=True))
    from megatron_calibclip.rollout.vllm_engine import VllmRolloutEngine

    settings = cfg.rollout.vllm
    bucket_bytes = settings.sync_bucket_mb * 2**20
    dtype = torch.float32 if cfg.rollout.precision == "fp32" else torch.bfloat16
    return VllmRolloutEngine(
        hf_config_from_model_config(model_cfg, dtype), settings,
        precision=cfg.rollout.precision, fp8_granularity=cfg.rollout_recipe.granularity,
        eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        stop_ids=getattr(tokenizer, "stop_ids", ()),
        bos_id=getattr(tokenizer, "bos_id", None),
        weights=lambda: hf_weight_buckets(policy, model_cfg, bucket_bytes, dtype),
        expected_tensors=hf_tensor_count(model_cfg),
        max_model_len=vllm_max_model_len(cfg, model_cfg), seed=cfg.run.seed,
        device=model_device(policy))
