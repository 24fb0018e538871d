"""A batch of rollouts laid out the way the trainer consumes it.

tokens [B, P + R]: prompts left-padded to P columns, responses right-padded to R columns.
Shifted per-token tensors ([B, P + R - 1], index t scores token t + 1) carry the response
mask and the rollout log-probs, so that trainer log-probs line up with no re-indexing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """What every engine's generate() refuses: no prompt, or an empty one."""
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # [B, P + R] long
    prompt_width: int  # P
    prompt_lengths: torch.Tensor  # [B] real prompt tokens (the rest of P is left padding)
    response_lengths: torch.Tensor  # [B] generated tokens incl. EOS
    finished: torch.Tensor  # [B] bool: ended with EOS (not cut at max_new_tokens)
    rollout_logprobs: torch.Tensor  # [B, P + R - 1] fp32, 0 outside the response
    pad_id: int

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_mask(self) -> torch.Tensor:
        """[B, P + R - 1] bool: positions whose target is a response token."""
        b, width = self.tokens.shape
        # column of the scored token
        target_col = torch.arange(1, width, device=self.tokens.device).unsqueeze(0)
        start = self.prompt_width
        end = start + self.response_lengths.unsqueeze(1)
        return (target_col >= start) & (target_col < end)

    @property
    def key_padding(self) -> torch.Tensor:
        """[B, P + R] bool: True on left padding (keys nobody may attend to)."""
        b, width = self.tokens.shape
        col = torch.arange(width, device=self.tokens.device).unsqueeze(0)
        return col < (self.prompt_width - self.prompt_lengths).unsqueeze(1)

    def attention_mask(self) -> torch.Tensor:
        """megatron convention [B, 1, 1, S] with True = masked (left-padding keys)."""
        return self.key_padding[:, None, None, :]

    def responses(self) -> list[list[int]]:
        out = []
        for i in range(self.batch_size):
            n = int(self.response_lengths[i])
            out.append(self.tokens[i, self.prompt_width: self.prompt_width + n].tolist())
        return out

    def select(self, index: torch.Tensor) -> "RolloutBatch":
        """The rows in `index` (e.g. after DAPO's dynamic-sampling filter)."""
        return RolloutBatch(self.tokens[index], self.prompt_width, self.prompt_lengths[index],
                            self.response_lengths[index], self.finished[index],
                            self.rollout_logprobs[index], self.pad_id)
