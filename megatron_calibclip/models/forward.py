"""From token ids to per-token log-probs and entropies through a (TP-sharded) GPTModel.

Next-token convention: position t of the output scores token t+1, so for tokens [b, s] the
results are [b, s-1]. Log-probs and entropies are computed vocab-parallel (no gather).
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_calibclip.parallel.vocab_parallel import vocab_parallel_logprobs_entropy


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    """0..s-1 for every row: the trainer puts each row's valid tokens first (trainer/layout.py),
    so they start at 0; elsewhere left padding is handled by the attention mask."""
    b, s = tokens.shape
    return torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)


def forward_logits(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Logits [b, s, V_padded / tp] of a single-stage (PP=1) model."""
    if position_ids is None:
        position_ids = position_ids_for(tokens)
    return model(tokens, position_ids, attention_mask)


def shifted_logprobs_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, true_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) and the entropy at t, both [b, s-1], fp32."""
    group = parallel_state.get_tensor_model_parallel_group()
    return vocab_parallel_logprobs_entropy(
        logits[:, :-1], tokens[:, 1:], true_vocab_size=true_vocab_size, group=group
    )
