"""Tokenised prompts served in seeded, resumable batches.

The cursor (epoch, position) is part of the checkpoint, so a resumed run sees exactly the
prompts an uninterrupted run would have seen. Prompts longer than `max_prompt_tokens` are
an error or a counted skip, never silently truncated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from megatron_calibclip.data.sources import DataError, PromptRecord, SkipCounter
from megatron_calibclip.data.template import PromptTemplate


@dataclass(frozen=True)
class TokenizedPrompt:
    record: PromptRecord
    text: str  # the rendered prompt
    ids: tuple[int, ...]  # its token ids


class PromptDataset:
    """Records -> tokenised prompts; `next_batch(n)` walks a seeded permutation per epoch."""

    def __init__(
        self,
        records: Sequence[PromptRecord],
        tokenizer,
        *,
        template: PromptTemplate | None = None,
        max_prompt_tokens: int = 512,
        on_too_long: Literal["error", "skip"] = "error",
        seed: int = 0,
        skips: SkipCounter | None = None,
    ):
        self.template = template or PromptTemplate()
        self.skips = skips if skips is not None else SkipCounter()
        self.items: list[TokenizedPrompt] = []
        for rec in records:
            text = self.template.render(rec.prompt, tokenizer)
            ids = tuple(tokenizer.encode(text))
            if len(ids) > max_prompt_tokens:
                if on_too_long == "error":
                    raise DataError(
                        f"{rec.source}: prompt has {len(ids)} tokens > max_prompt_tokens "
                        f"{max_prompt_tokens} (raise the limit or set on_too_long: skip)"
                    )
                self.skips.add("prompt too long")
                continue
            if not ids:
                raise DataError(f"{rec.source}: prompt tokenises to nothing")
            self.items.append(TokenizedPrompt(rec, text, ids))
        if not self.items:
            raise DataError(f"no usable prompts ({self.skips.total} skipped: {self.skips.skipped})")
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def __len__(self) -> int:
        return len(self.items)

    def next_batch(self, n: int) -> list[TokenizedPrompt]:
        """The next n prompts (crossing epochs as needed, each epoch reshuffled)."""
        out = []
        while len(out) < n:
            if self.position >= len(self.items):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self.items[int(self._order[self.position])])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "size": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.items) or state["seed"] != self.seed:
            raise DataError(
                f"data cursor was saved for {state['size']} prompts / seed {state['seed']}, "
                f"this dataset has {len(self.items)} / seed {self.seed}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
