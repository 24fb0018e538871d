"""The probe's token data: chain_sum text or samples from the model, byte or HF tokens, and
the two micro-batch layouts the layout source compares.

Sequences live on the host (parallel/devices.HOST): seeded draws are then the same on every
machine, and each micro-batch is padded onto the model's device when it is used."""
from __future__ import annotations

import torch

from megatron_calibclip.parallel.devices import HOST
from megatron_calibclip.probe.config import (
    BOS_ID,
    BYTE_OFFSET,
    EOS_ID,
    PAD_ID,
    ProbeConfig,
    ProbeError,
)


def _byte_ids(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def _chain_sum(n: int, seed: int) -> list[tuple[str, str]]:
    from megatron_calibclip.data import reasoning_gym_records

    return [(r.prompt, r.answer) for r in reasoning_gym_records("chain_sum", n, seed)]


class _Tokens:
    """Byte tokens (id = byte + 3; pad 0, BOS 1, EOS 2) or an HF tokenizer, one interface."""

    def __init__(self, vocab_size: int, tokenizer=None):
        self.tok = tokenizer
        if tokenizer is None and vocab_size < BYTE_OFFSET + 256:
            raise ProbeError(f"byte tokens need a vocabulary of >= {BYTE_OFFSET + 256}, the "
                             f"model has {vocab_size}")
        self.pad = tokenizer.pad_id if tokenizer is not None else PAD_ID
        self.eos = tokenizer.eos_id if tokenizer is not None else EOS_ID
        self.special_lo = 0 if tokenizer is not None else BYTE_OFFSET

    def text(self, text: str) -> list[int]:
        if self.tok is None:
            return [BOS_ID] + _byte_ids(text)
        return list(self.tok.encode(text))

    def prompt(self, question: str) -> list[int]:
        """What a response is sampled after: the chat template for HF instruct models."""
        if self.tok is None:
            return [BOS_ID] + _byte_ids(question + " ")
        template = getattr(self.tok, "apply_chat_template", None)
        if template is not None and getattr(getattr(self.tok, "_tok", None), "chat_template",
                                            None):
            return list(self.tok.encode(template(question)))
        return list(self.tok.encode(question + " "))


def make_sequences(cfg: ProbeConfig, n: int, seed: int, vocab_size: int, tokenizer=None,
                   corrupt: float = 0.0, eos: bool = False) -> list[torch.Tensor]:
    """n token sequences (1-D LongTensors, length >= 2): chain_sum question + answer text (EOS
    appended if `eos`), or random ids (tokens == "random"); with `corrupt` > 0 (text only)
    that fraction of positions >= 1 gets uniform random ids."""
    if cfg.tokens == "random":
        g = torch.Generator(device=HOST).manual_seed(seed)
        lengths = torch.randint(cfg.max_len // 2, cfg.max_len + 1, (n,), generator=g, device=HOST)
        return [torch.randint(1, vocab_size, (int(L),), generator=g, device=HOST) for L in lengths]
    toks = _Tokens(vocab_size, tokenizer)
    seqs = [(toks.text(f"{q} {a}") + ([toks.eos] if eos else []))[:cfg.max_len]
            for q, a in _chain_sum(n, seed)]
    out = [torch.tensor(s, dtype=torch.long, device=HOST) for s in seqs if len(s) >= 2]
    if corrupt > 0:
        g = torch.Generator(device=HOST).manual_seed(seed + 29)
        for s in out:
            hit = torch.rand(len(s), generator=g, device=HOST) < corrupt
            hit[0] = False
            s[hit] = torch.randint(toks.special_lo, vocab_size, (int(hit.sum()),), generator=g,
                                   device=HOST)
    return out


def make_samples(model, cfg: ProbeConfig, n: int, seed: int, vocab_size: int, tokenizer=None
                 ) -> tuple[list[torch.Tensor], list[int]]:
    """chain_sum questions + responses sampled from the model in its current precision;
    returns the sequences and, per sequence, the index of its first response token."""
    from megatron_calibclip.rollout import MegatronRolloutEngine, SamplingParams

    toks = _Tokens(vocab_size, tokenizer)
    prompts = [toks.prompt(q)[-(cfg.max_len - 1):] for q, _ in _chain_sum(n, seed)]
    engine = MegatronRolloutEngine(model, vocab_size, toks.eos, toks.pad)
    batch = engine.generate(prompts, SamplingParams(temperature=cfg.temperature,
                                                    max_new_tokens=cfg.sample_len), seed)
    seqs, starts = [], []
    for i, response in enumerate(batch.responses()):
        seqs.append(torch.tensor(prompts[i] + response, dtype=torch.long, device=HOST))
        starts.append(len(prompts[i]))
    return seqs, starts


def make_layouts(n: int, old_mb: int, new_mb: int, seed: int
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """Layout A: consecutive groups of old_mb; layout B: groups of new_mb after a shuffle."""
    g = torch.Generator(device=HOST).manual_seed(seed + 17)
    order = torch.randperm(n, generator=g, device=HOST).tolist()
    a = [list(range(i, min(i + old_mb, n))) for i in range(0, n, old_mb)]
    b = [order[i:i + new_mb] for i in range(0, n, new_mb)]
    return a, b
