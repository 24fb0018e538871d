"""Tiny random Hugging Face models of every supported family, built from a config (no download).

Every parameter, norms and biases included, is random (HF initialises norms to 1 and biases to
0, which would hide a swapped q_norm/k_norm or a misplaced bias).
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 1100  # not a multiple of 128: TP=1 pads to 1152, TP=2 to 1280
SEQ = 12


def _config(family: str, tied: bool):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=tied)
    if family == "llama":
        return LlamaConfig(rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                           **common)
    if family == "qwen2":
        return Qwen2Config(rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    if family == "qwen3":  # head_dim 32 != hidden / heads = 16
        return Qwen3Config(head_dim=32, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                           **common)
    raise ValueError(family)


CASES = {f"{fam}-{'tied' if tied else 'untied'}": (fam, tied)
         for fam in ("llama", "qwen2", "qwen3") for tied in (True, False)}


def build_hf_model(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    family, tied = CASES[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family, tied), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def tokens(vocab: int = VOCAB, batch: int = 2, seq: int = SEQ, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def save_hf_model(model, folder: Path) -> Path:
    model.save_pretrained(str(folder))
    return folder


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()
