"""Hugging Face config.json <-> ModelConfig for the Llama, Qwen2 and Qwen3 families.

Why strict: a field we do not model (RoPE scaling, sliding windows, biases on o_proj/MLP, a
non-SiLU activation) would convert silently into a different network. Every such field is
checked and named in the error instead.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from megatron_calibclip.checkpoint.errors import ConversionError
from megatron_calibclip.models.config import ModelConfig

# model_type -> (family, architecture class name)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise ConversionError(f"{folder} has no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ConversionError(f"{path} is not valid JSON: {err}") from err


def _rope_theta(hf: dict[str, Any], where: str) -> float:
    params = hf.get("rope_parameters") or {}  # transformers >= 5
    scaling = hf.get("rope_scaling") or {}  # transformers 4.x
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ConversionError(f"{where}: RoPE type {rope_type!r} is not supported (only "
                              f"'default'; no RoPE scaling)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def model_config_from_hf(hf: dict[str, Any], where: str = "config.json",
                         make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our ModelConfig for an HF config dict; ConversionError naming any unsupported field."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConversionError(
            f"{where}: unsupported architecture {hf.get('architectures')} (model_type "
            f"{model_type!r}); supported model_type: {sorted(ARCHITECTURES)}")
    family = ARCHITECTURES[model_type][0]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{where}: hidden_act {act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise ConversionError(f"{where}: mlp_bias=true is not supported")
    if family in ("llama", "qwen3") and hf.get("attention_bias"):
        raise ConversionError(f"{where}: attention_bias=true (bias on o_proj) is not supported")
    if hf.get("use_sliding_window"):
        raise ConversionError(f"{where}: use_sliding_window=true is not supported")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        kv_channels = None
        if head_dim is not None and (hidden % heads or int(head_dim) != hidden // heads):
            kv_channels = int(head_dim)
        return ModelConfig(
            family=family,
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(hf["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            vocab_size=int(hf["vocab_size"]),
            kv_channels=kv_channels,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope_theta=_rope_theta(hf, where),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        )
    except KeyError as err:
        raise ConversionError(f"{where}: required field {err.args[0]!r} is missing") from err
    except ValueError as err:  # ConfigError from ModelConfig validation
        raise ConversionError(f"{where}: {err}") from err


def check_matches_preset(cfg: ModelConfig, name: str) -> None:
    """ConversionError unless `cfg` has the architecture of preset `name` (a guard for CLIs)."""
    from megatron_calibclip.models.config import get_preset

    preset = get_preset(name)
    for f in ("family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "vocab_size", "head_dim", "qkv_bias", "qk_norm",
              "tie_embeddings", "rope_theta", "norm_eps"):
        a, b = getattr(cfg, f), getattr(preset, f)
        if not (math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) else a == b):
            raise ConversionError(f"config.json does not describe preset {name!r}: {f} is {a}, "
                                  f"the preset has {b}")


def hf_dtype(hf: dict[str, Any]) -> torch.dtype:
    """The dtype the HF weights are stored in (config 'dtype' / 'torch_dtype'; fp32 if unset)."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return _DTYPES.get(str(name), torch.float32)


def hf_config_from_model_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32
                                ) -> dict[str, Any]:
    """A config.json for `cfg` (used when a checkpoint carries no original HF config)."""
    model_type = cfg.family
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type][1]],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "dtype": {v: k for k, v in _DTYPES.items()}[dtype],
    }
    if model_type != "qwen2":
        out["attention_bias"] = False
        out["mlp_bias"] = False
    return out
