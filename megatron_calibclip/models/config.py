"""One typed model config for the Llama, Qwen2 and Qwen3 families, and the presets we ship.

The families differ only in a few switches, all of them fields here: QKV bias (Qwen2),
QK-norm (Qwen3), an explicit head dimension (Qwen3: head_dim != hidden / heads for 32B),
tied or untied embeddings, RoPE theta, the RMSNorm epsilon. Everything else (RMSNorm,
SwiGLU, RoPE, GQA, no linear biases) is common.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_calibclip.config import ConfigError, from_dict

Family = Literal["llama", "qwen2", "qwen3"]


@dataclass(frozen=True)
class ModelConfig:
    family: Family  # architecture family: decides defaults of qkv_bias / qk_norm in presets
    num_layers: int  # transformer layers
    hidden_size: int  # model width
    ffn_hidden_size: int  # SwiGLU intermediate size (per gate/up projection)
    num_attention_heads: int  # query heads
    num_query_groups: int  # key/value heads (GQA); == num_attention_heads for MHA
    vocab_size: int  # true vocabulary size (before padding for TP)
    kv_channels: Optional[int] = None  # head dim; None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 4096  # longest sequence the RoPE tables are built for
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    qkv_bias: bool = False  # bias on the Q/K/V projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each query/key head before RoPE (Qwen3)
    tie_embeddings: bool = False  # output layer shares the input embedding matrix
    make_vocab_size_divisible_by: int = 128  # pad the vocabulary to a multiple of this x TP
    init_method_std: float = 0.02  # std of the random initialisation (tests, demo)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings",
                     "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads}); set model.kv_channels"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary padded so that every TP rank holds an equal, aligned slice."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tensor_parallel(self, tp: int) -> None:
        """TP must divide the heads and the KV groups (megatron shards whole heads)."""
        if self.num_attention_heads % tp or self.num_query_groups % tp:
            raise ConfigError(
                f"tensor-parallel size {tp} must divide num_attention_heads "
                f"({self.num_attention_heads}) and num_query_groups ({self.num_query_groups})"
            )
        if self.ffn_hidden_size % tp:
            raise ConfigError(
                f"tensor-parallel size {tp} must divide ffn_hidden_size ({self.ffn_hidden_size})"
            )

    def num_parameters(self) -> int:
        """Parameter count of the unpadded model (what model cards publish)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attn = h * (q + 2 * kv) + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * d
        mlp = 3 * h * f
        norms = 2 * h
        per_layer = attn + mlp + norms
        embed = self.vocab_size * h
        out = 0 if self.tie_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + embed + out + h  # + final norm


def _preset(**kw) -> ModelConfig:
    return ModelConfig(**kw)


# Published architecture numbers (Hugging Face config.json of each model).
PRESETS: dict[str, ModelConfig] = {
    # Small and fast, for tests and the demo. Llama-style: GQA 4 heads / 2 KV groups, tied.
    "tiny": _preset(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                    num_attention_heads=4, num_query_groups=2, vocab_size=1000,
                    max_position_embeddings=256, rope_theta=10000.0, tie_embeddings=True,
                    make_vocab_size_divisible_by=8),
    "tiny-qwen2": _preset(family="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, vocab_size=1000,
                          max_position_embeddings=256, rope_theta=1e6, norm_eps=1e-6,
                          qkv_bias=True, make_vocab_size_divisible_by=8),
    "tiny-qwen3": _preset(family="qwen3", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                          num_attention_heads=4, num_query_groups=2, kv_channels=32,
                          vocab_size=1000, max_position_embeddings=256, rope_theta=1e6,
                          norm_eps=1e-6, qk_norm=True, make_vocab_size_divisible_by=8),
    # HuggingFaceTB/SmolLM2-135M(-Instruct): 134.5M parameters.
    "smollm2-135m": _preset(family="llama", num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                            num_attention_heads=9, num_query_groups=3, vocab_size=49152,
                            max_position_embeddings=8192, rope_theta=100000.0, norm_eps=1e-5,
                            tie_embeddings=True),
    # meta-llama/Meta-Llama-3-8B: 8.03B.
    "llama3-8b": _preset(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336,
                         num_attention_heads=32, num_query_groups=8, vocab_size=128256,
                         max_position_embeddings=8192, rope_theta=500000.0, norm_eps=1e-5),
    # Qwen/Qwen3-8B(-Base): 8.2B.
    "qwen3-8b": _preset(family="qwen3", num_layers=36, hidden_size=4096, ffn_hidden_size=12288,
                        num_attention_heads=32, num_query_groups=8, kv_channels=128,
                        vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                        norm_eps=1e-6, qk_norm=True),
    # Qwen/Qwen3-14B(-Base): 14.8B.
    "qwen3-14b": _preset(family="qwen3", num_layers=40, hidden_size=5120, ffn_hidden_size=17408,
                         num_attention_heads=40, num_query_groups=8, kv_channels=128,
                         vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                         norm_eps=1e-6, qk_norm=True),
    # Qwen/Qwen2.5-32B: 32.5B (31.0B non-embedding).
    "qwen2.5-32b": _preset(family="qwen2", num_layers=64, hidden_size=5120, ffn_hidden_size=27648,
                           num_attention_heads=40, num_query_groups=8, vocab_size=152064,
                           max_position_embeddings=131072, rope_theta=1e6, norm_eps=1e-5,
                           qkv_bias=True),
    # Qwen/Qwen3-32B: 32.8B.
    "qwen3-32b": _preset(family="qwen3", num_layers=64, hidden_size=5120, ffn_hidden_size=25600,
                         num_attention_heads=64, num_query_groups=8, kv_channels=128,
                         vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
                         norm_eps=1e-6, qk_norm=True),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, optionally with fields replaced (validated)."""
    if name not in PRESETS:
        raise ConfigError(f"model preset {name!r} is not one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    if overrides:
        data = dataclasses.asdict(cfg)
        data.update(overrides)
        cfg = from_dict(ModelConfig, data, "model")
    return cfg
