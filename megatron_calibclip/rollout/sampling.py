"""Next-token sampling: temperature, top-k, top-p, and the log-prob the trainer recomputes.

The returned log-prob is that of the sampled token under softmax(logits / T) over the whole
(unpadded) vocabulary, *not* renormalised after top-k/top-p truncation: it is exactly what
the trainer recomputes from its own forward (with the same temperature), so the
rollout/trainer ratio used by TIS/MIS compares like with like.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_calibclip.config import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # > 0; logits are divided by it (also in the trainer)
    top_p: float = 1.0  # nucleus: keep the smallest set with mass >= top_p; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_new_tokens: int = 64  # response length limit (EOS included)
    greedy: bool = False  # argmax instead of sampling (evaluation)

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"sampling.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, V] (unpadded vocabulary) -> (token ids [b], log-probs [b]) in fp32."""
    scaled = logits.float() / params.temperature
    logp_full = torch.log_softmax(scaled, dim=-1)
    if params.greedy:
        tokens = logp_full.argmax(dim=-1)
    else:
        filtered = scaled.clone()
        if params.top_k and params.top_k < filtered.shape[-1]:
            kth = torch.topk(filtered, params.top_k, dim=-1).values[..., -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # drop a token if the mass strictly before it already reaches top_p
            drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            filtered = filtered.masked_fill(drop, float("-inf"))
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp_full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
