"""How many parameters one GPU holds for a model at a given TP/PP.

Why per stage: with pipeline parallelism the first stage also holds the input embedding and
the last stage the output layer (a 152k x 5120 matrix is 0.78B parameters, more than four
Qwen3-32B layers), so the most loaded stage, not the average, decides whether a layout
fits. Linear weights are counted apart from the rest because only they get FP8 caches.
Megatron pads the vocabulary to a multiple of 128 x TP; the padded size is used here.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_calibclip.models.config import ModelConfig


@dataclass(frozen=True)
class StageParams:
    stage: int  # pipeline stage index
    layers: int  # transformer layers on this stage
    linear: int  # parameters of the layers' linear weights on one TP rank (FP8 GEMMs)
    other: int  # norms, biases, embedding / output layer on one TP rank

    @property
    def total(self) -> int:
        return self.linear + self.other


def layer_linear_params(m: ModelConfig) -> int:
    """QKV, output projection, gate/up and down projections of one layer (unsharded)."""
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    return h * (q + 2 * kv) + q * h + 3 * h * m.ffn_hidden_size


def layer_other_params(m: ModelConfig, tp: int) -> int:
    """Per TP rank: QKV bias (sharded), QK-norm weights and the two RMSNorms (replicated)."""
    d = m.head_dim
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    out = 2 * m.hidden_size
    if m.qkv_bias:
        out += (q + 2 * kv) // tp
    if m.qk_norm:
        out += 2 * d
    return out


def layers_on_stage(num_layers: int, pp: int, stage: int) -> int:
    """Megatron's even split; a remainder goes to the first stages."""
    base, extra = divmod(num_layers, pp)
    return base + (1 if stage < extra else 0)


def stage_params(m: ModelConfig, tp: int, pp: int, stage: int) -> StageParams:
    layers = layers_on_stage(m.num_layers, pp, stage)
    vocab = m.padded_vocab_size(tp)
    embed = vocab * m.hidden_size // tp
    other = layers * layer_other_params(m, tp)
    first, last = stage == 0, stage == pp - 1
    if first:
        other += embed
    if last:
        other += m.hidden_size  # final norm
        # untied: its own output layer; tied with PP > 1: Megatron keeps a copy of the
        # embedding on the last stage for the output projection
        if not m.tie_embeddings or not first:
            other += embed
    return StageParams(stage, layers, layers * layer_linear_params(m) // tp, other)


def all_stages(m: ModelConfig, tp: int, pp: int) -> list[StageParams]:
    return [stage_params(m, tp, pp, s) for s in range(pp)]


def check_layout(m: ModelConfig, tp: int, pp: int) -> str | None:
    """Why Megatron cannot shard this model at TP/PP, or None if it can."""
    if m.num_attention_heads % tp or m.num_query_groups % tp:
        return (f"TP={tp} does not divide {m.num_attention_heads} heads and "
                f"{m.num_query_groups} KV groups")
    if m.ffn_hidden_size % tp:
        return f"TP={tp} does not divide the FFN size {m.ffn_hidden_size}"
    if pp > m.num_layers:
        return f"PP={pp} is more than the {m.num_layers} layers"
    return None


def total_params(m: ModelConfig) -> int:
    """Whole model with the padded vocabulary (what Megatron allocates at TP=1)."""
    return stage_params(m, 1, 1, 0).total
