"""How a question becomes the text the policy continues.

Base models get a plain template ("Question: ...\\nAnswer:"); instruct models with an HF
tokenizer may use the tokenizer's own chat template instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_calibclip.config import ConfigError


@dataclass(frozen=True)
class PromptTemplate:
    kind: Literal["plain", "chat"] = "plain"  # plain: format string; chat: tokenizer template
    # used when kind == "plain"; must contain {prompt}
    text: str = "Question: {prompt}\nAnswer:"

    def __post_init__(self) -> None:
        if self.kind == "plain" and "{prompt}" not in self.text:
            raise ConfigError("template.text must contain '{prompt}'")

    def render(self, prompt: str, tokenizer=None) -> str:
        if self.kind == "chat":
            if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
                raise ConfigError("template.kind 'chat' needs a Hugging Face tokenizer folder")
            return tokenizer.apply_chat_template(prompt)
        return self.text.format(prompt=prompt)
