"""Hugging Face <-> Megatron weights as a declarative table of names, shapes and layouts.

Why a table: the three families differ only in optional rows (QKV bias, QK-norm, an untied
lm_head), and each direction of the conversion, the validation of a folder (missing, extra,
wrong shape) and the tests all read the same rows, so they cannot drift apart
(Megatron-Bridge's AutoMapping / QKVMapping / GatedMLPMapping idea, without its machinery).

Megatron names are the keys of megatron-core's distributed checkpoint with one layer index
(`decoder.layers.{layer}.…`): the TE-style names (`linear_qkv.layer_norm_weight`) that the
local spec also maps its norms to, so checkpoints are interchangeable between specs. Tensors
here are whole (not TP-sharded) and have the true vocabulary (not TP-padded) rows.
Shapes are symbolic: vocab, hidden, ffn, q (= heads x head_dim), kv (= groups x head_dim),
head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megatron_calibclip.models.config import ModelConfig

Dims = tuple[str, ...]


def dims(cfg: ModelConfig) -> dict[str, int]:
    d = cfg.head_dim
    return {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "ffn": cfg.ffn_hidden_size,
            "q": cfg.num_attention_heads * d, "kv": cfg.num_query_groups * d, "head_dim": d}


def _shape(symbols: Dims, cfg: ModelConfig) -> tuple[int, ...]:
    table = dims(cfg)
    return tuple(table[s] for s in symbols)


def _enabled(when: Optional[str], cfg: ModelConfig) -> bool:
    return {None: True, "qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm,
            "untied": not cfg.tie_embeddings}[when]


@dataclass(frozen=True)
class Rename:
    """The same tensor under two names."""

    mcore: str
    hf: str
    shape: Dims
    when: Optional[str] = None  # None, "qkv_bias", "qk_norm" or "untied"

    def hf_names(self) -> tuple[str, ...]:
        return (self.hf,)

    def hf_shapes(self, cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
        return (_shape(self.shape, cfg),)

    def mcore_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        return _shape(self.shape, cfg)

    def to_mcore(self, cfg: ModelConfig, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return tensors[0]

    def to_hf(self, cfg: ModelConfig, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]


@dataclass(frozen=True)
class QKV:
    """Separate q/k/v projections <-> megatron's fused linear_qkv, interleaved per KV group:
    rows [q heads of group 0; k_0; v_0; q heads of group 1; k_1; v_1; ...] (so TP cuts whole
    groups)."""

    mcore: str
    q: str
    k: str
    v: str
    trailing: Dims = ("hidden",)  # () for the bias
    when: Optional[str] = None

    def hf_names(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def hf_shapes(self, cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
        t = _shape(self.trailing, cfg)
        d = dims(cfg)
        return ((d["q"], *t), (d["kv"], *t), (d["kv"], *t))

    def mcore_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        d = dims(cfg)
        return (d["q"] + 2 * d["kv"], *_shape(self.trailing, cfg))

    def _group_rows(self, cfg: ModelConfig) -> tuple[int, int, int]:
        per_group = cfg.num_attention_heads // cfg.num_query_groups
        return per_group * cfg.head_dim, cfg.head_dim, cfg.num_query_groups

    def to_mcore(self, cfg: ModelConfig, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        q_rows, kv_rows, groups = self._group_rows(cfg)
        q, k, v = tensors
        t = q.shape[1:]
        fused = torch.cat([q.reshape(groups, q_rows, *t), k.reshape(groups, kv_rows, *t),
                           v.reshape(groups, kv_rows, *t)], dim=1)
        return fused.reshape(groups * (q_rows + 2 * kv_rows), *t)

    def to_hf(self, cfg: ModelConfig, tensor: torch.Tensor) -> list[torch.Tensor]:
        q_rows, kv_rows, groups = self._group_rows(cfg)
        t = tensor.shape[1:]
        q, k, v = tensor.reshape(groups, q_rows + 2 * kv_rows, *t).split(
            [q_rows, kv_rows, kv_rows], dim=1)
        return [x.reshape(-1, *t) for x in (q, k, v)]


@dataclass(frozen=True)
class GatedMLP:
    """gate_proj and up_proj <-> megatron's linear_fc1 = [gate; up] (SwiGLU)."""

    mcore: str
    gate: str
    up: str
    when: Optional[str] = None

    def hf_names(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def hf_shapes(self, cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
        return (_shape(("ffn", "hidden"), cfg),) * 2

    def mcore_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        return (2 * cfg.ffn_hidden_size, cfg.hidden_size)

    def to_mcore(self, cfg: ModelConfig, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(tensors), dim=0)

    def to_hf(self, cfg: ModelConfig, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(tensor.chunk(2, dim=0))


Rule = Union[Rename, QKV, GatedMLP]

# `{layer}` is the global layer index. Llama, Qwen2 and Qwen3 share these names.
GLOBAL_RULES: tuple[Rule, ...] = (
    Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", ("vocab", "hidden")),
    Rename("decoder.final_layernorm.weight", "model.norm.weight", ("hidden",)),
    Rename("output_layer.weight", "lm_head.weight", ("vocab", "hidden"), when="untied"),
)
_L = "model.layers.{layer}"
_M = "decoder.layers.{layer}"
LAYER_RULES: tuple[Rule, ...] = (
    Rename(f"{_M}.self_attention.linear_qkv.layer_norm_weight", f"{_L}.input_layernorm.weight",
           ("hidden",)),
    QKV(f"{_M}.self_attention.linear_qkv.weight", f"{_L}.self_attn.q_proj.weight",
        f"{_L}.self_attn.k_proj.weight", f"{_L}.self_attn.v_proj.weight"),
    QKV(f"{_M}.self_attention.linear_qkv.bias", f"{_L}.self_attn.q_proj.bias",
        f"{_L}.self_attn.k_proj.bias", f"{_L}.self_attn.v_proj.bias", trailing=(),
        when="qkv_bias"),
    Rename(f"{_M}.self_attention.q_layernorm.weight", f"{_L}.self_attn.q_norm.weight",
           ("head_dim",), when="qk_norm"),
    Rename(f"{_M}.self_attention.k_layernorm.weight", f"{_L}.self_attn.k_norm.weight",
           ("head_dim",), when="qk_norm"),
    Rename(f"{_M}.self_attention.linear_proj.weight", f"{_L}.self_attn.o_proj.weight",
           ("hidden", "q")),
    Rename(f"{_M}.mlp.linear_fc1.layer_norm_weight", f"{_L}.post_attention_layernorm.weight",
           ("hidden",)),
    GatedMLP(f"{_M}.mlp.linear_fc1.weight", f"{_L}.mlp.gate_proj.weight",
             f"{_L}.mlp.up_proj.weight"),
    Rename(f"{_M}.mlp.linear_fc2.weight", f"{_L}.mlp.down_proj.weight", ("hidden", "ffn")),
)
# Megatron names whose first dimension is the (TP-padded) vocabulary.
VOCAB_NAMES = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})
# HF tensors that carry no weights (recomputed buffers of older checkpoints).
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)
# Local-spec parameter names -> the checkpoint (TE-style) names used above.
LOCAL_SPEC_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@dataclass(frozen=True)
class Entry:
    """A rule resolved for one layer of one config: concrete names and shapes."""

    rule: Rule
    layer: Optional[int]
    mcore: str  # megatron name with the layer index
    hf: tuple[str, ...]  # HF names, in the order to_mcore takes them
    hf_shapes: tuple[tuple[int, ...], ...]
    mcore_shape: tuple[int, ...]

    @property
    def stacked_key(self) -> str:
        """Key in megatron's distributed checkpoint, where layers are stacked on dim 0."""
        return self.rule.mcore.replace("{layer}.", "")

    def to_mcore(self, cfg: ModelConfig, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.rule.to_mcore(cfg, tensors)

    def to_hf(self, cfg: ModelConfig, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.hf, self.rule.to_hf(cfg, tensor)))


def resolve(cfg: ModelConfig) -> list[Entry]:
    """Every tensor of a model with config `cfg`, in a fixed order."""
    out: list[Entry] = []

    def add(rule: Rule, layer: Optional[int]) -> None:
        if not _enabled(rule.when, cfg):
            return
        fmt = (lambda s: s.format(layer=layer)) if layer is not None else (lambda s: s)
        out.append(Entry(rule, layer, fmt(rule.mcore), tuple(fmt(n) for n in rule.hf_names()),
                         rule.hf_shapes(cfg), rule.mcore_shape(cfg)))

    for rule in GLOBAL_RULES:
        add(rule, None)
    for layer in range(cfg.num_layers):
        for rule in LAYER_RULES:
            add(rule, layer)
    return out


def local_to_checkpoint_name(name: str) -> str:
    """'decoder.layers.3.input_layernorm.weight' -> '…linear_qkv.layer_norm_weight' (local spec)."""
    for local, ckpt in LOCAL_SPEC_ALIASES.items():
        if name.endswith("." + local):
            return name[: -len(local)] + ckpt
    return name
