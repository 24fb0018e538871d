"""Memory of generation: the KV cache and the prefill logits.

Why it matters for RL: the policy generates its own rollouts on the training GPUs, at the
same TP/PP, while its weights, gradient buffer and optimizer states stay resident. The KV
cache holds K and V for every layer of the stage, every KV head of the TP rank (GQA: 8
groups for all our large presets, so TP up to 8 still divides them), every sequence of
the rollout batch at full length: 2 x L/pp x g/tp x d x bytes x batch x seq.

Our engine (rollout/engine.py) runs the prefill through the normal output layer with
`runtime_gather_output=True` and keeps only the last position, so during the prefill the
full-vocabulary logits of every prompt position exist once, gathered over TP. For a 152k
vocabulary that is 0.3 MB per prompt token; it is counted here so that the planner shows it.
"""
from __future__ import annotations

from megatron_calibclip.models.config import ModelConfig


def kv_cache_bytes(m: ModelConfig, layers: int, tp: int, batch: int, seq: int,
                   dtype_bytes: int = 2) -> float:
    """K and V of `layers` layers for `batch` sequences of `seq` tokens on one TP rank."""
    groups = max(1, m.num_query_groups // tp)
    return 2.0 * layers * groups * m.head_dim * dtype_bytes * batch * seq


def prefill_logits_bytes(m: ModelConfig, tp: int, batch: int, prompt: int) -> float:
    """BF16 logits of all prompt positions: the local vocabulary shard plus the TP gather."""
    vocab = m.padded_vocab_size(tp)
    local = 2.0 * batch * prompt * vocab / tp
    gathered = 2.0 * batch * prompt * vocab if tp > 1 else 0.0
    return local + gathered
