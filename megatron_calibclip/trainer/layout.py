"""Where a row's tokens sit when the model sees them: valid tokens first, from column 0.

Why: batches are left-padded (rollout/batch.py: prompts end in one column, so responses start
in one), but attention backends read a padding mask differently. Torch-style masks honour any
masked key; TE's cuDNN fused attention reduces a `padding_causal` mask to a length per row and
takes columns [0, len) as the valid ones (models/te_stand_in.py). A left-padded row would
then attend to its padding and lose its tail, in the policy, the shadow and the reference
alike, so the calibration would stay self-consistent and hide it.

At the model seam (trainer/forward.py, the one path of old, reference, shadow and update
passes) each row is rotated so that its leading padding moves behind its tokens, and the
logits are rotated back before any loss: a right-padded layout that every backend reads the
same way, with positions 0.. for the real tokens (as vLLM numbers them). docs/trainer.md
argues this against packing (THD).
"""
from __future__ import annotations

from typing import Optional

import torch


def leading_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b] count of masked key columns before each row's first valid one (all of them in a
    fully masked dummy row); `attention_mask` is megatron's [b, 1, 1, s], True = masked."""
    valid = ~attention_mask[:, 0, 0, :]
    return (valid.long().cumsum(-1) == 0).sum(-1)


def valid_tokens_first(tokens: torch.Tensor, attention_mask: Optional[torch.Tensor]
                       ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(tokens, mask, shift): each row rotated left by its leading padding, so its valid
    tokens start at column 0 and every masked key is at the end; shift is None when no row
    had leading padding (nothing moved)."""
    if attention_mask is None:
        return tokens, attention_mask, None
    lead = leading_padding(attention_mask)
    if not bool(lead.any()):
        return tokens, attention_mask, None
    s = tokens.shape[1]
    cols = (torch.arange(s, device=tokens.device).unsqueeze(0) + lead.unsqueeze(1)) % s
    return tokens.gather(1, cols), attention_mask.gather(-1, cols[:, None, None, :]), lead


def restore_columns(logits: torch.Tensor, shift: Optional[torch.Tensor]) -> torch.Tensor:
    """logits [b, s, ...] of rotated rows back in the batch's own columns (the inverse of
    valid_tokens_first; gradients flow through the index)."""
    if shift is None:
        return logits
    b, s = logits.shape[:2]
    cols = (torch.arange(s, device=logits.device).unsqueeze(0) - shift.unsqueeze(1)) % s
    rows = torch.arange(b, device=logits.device).unsqueeze(1)
    return logits[rows, cols]
