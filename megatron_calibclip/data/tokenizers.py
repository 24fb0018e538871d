"""Tokenizers behind one interface: a sentencepiece `.model` file or a Hugging Face folder.

The trainer needs only encode / decode / eos / pad / vocab size, so both kinds are wrapped
in the same small class. `train_sentencepiece` builds a small model on the fly (the tiny
CPU demo has no pretrained tokenizer small enough for its 1k-token vocabulary).
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable


class TokenizerError(ValueError):
    """The tokenizer file/folder is missing or unusable; the message names it."""


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int  # ids are in [0, vocab_size)
    eos_id: int  # ends a response
    stop_ids: tuple[int, ...]  # every id that ends a response: eos_id first, then the model's
    # generation_config.json eos_token_id(s) (Qwen3: <|im_end|> and <|endoftext|>)
    pad_id: int  # fills batches; never a target (masked)
    bos_id: int | None  # prepended to prompts when the model expects it, else None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class SentencePieceTokenizer:
    """A sentencepiece model file (`.model`)."""

    def __init__(self, path: str | Path, add_bos: bool = True):
        import sentencepiece as spm

        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"sentencepiece model not found: {p}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(p))
        except (RuntimeError, OSError) as err:
            raise TokenizerError(f"{p} is not a sentencepiece model: {err}") from err
        self.path = p
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = int(self._sp.eos_id())
        if self.eos_id < 0:
            raise TokenizerError(f"{p} defines no EOS piece (train it with eos_id >= 0)")
        self.stop_ids = (self.eos_id,)
        pad = int(self._sp.pad_id())
        self.pad_id = pad if pad >= 0 else self.eos_id
        bos = int(self._sp.bos_id())
        self.bos_id = bos if (add_bos and bos >= 0) else None

    def encode(self, text: str) -> list[int]:
        ids = list(self._sp.encode(text))
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        # ids past the tokenizer's pieces (a model vocabulary padded beyond it) decode to nothing
        keep = [int(i) for i in ids if int(i) not in (self.pad_id, self.eos_id, self.bos_id)
                and 0 <= int(i) < self.vocab_size]
        return self._sp.decode(keep)


class HFTokenizer:
    """A Hugging Face tokenizer folder (tokenizer.json / tokenizer_config.json)."""

    def __init__(self, folder: str | Path):
        p = Path(folder)
        if not p.is_dir():
            raise TokenizerError(f"Hugging Face tokenizer folder not found: {p}")
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise TokenizerError("HF tokenizers need the `hf` extra (pip install -e .[hf])") from err
        try:
            self._tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError) as err:
            raise TokenizerError(f"{p}: cannot load a tokenizer: {err}") from err
        self.path = p
        self.vocab_size = len(self._tok)
        if self._tok.eos_token_id is None:
            raise TokenizerError(f"{p}: the tokenizer has no eos_token")
        self.eos_id = int(self._tok.eos_token_id)
        self.stop_ids = generation_stop_ids(p, self.eos_id)
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.bos_id = None  # HF tokenizers add their own special tokens in encode

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(self, prompt: str) -> str:
        """The model's own chat template around one user turn (instruct models)."""
        return self._tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )


def generation_stop_ids(folder: str | Path, eos_id: int) -> tuple[int, ...]:
    """eos_id, then the other ids `generation_config.json` ends generation on (its
    eos_token_id: an int or a list), as transformers' generate and vLLM stop on them.

    Why: an instruct model's tokenizer names one EOS, its generation config several; Qwen3's
    tokenizer EOS is <|im_end|> while its generation config adds <|endoftext|>, which a model
    emits where a chat turn would have ended. Stopping on the tokenizer's EOS alone lets such a
    response run on to max_new_tokens (rollout/vllm_engine.py, rollout/engine.py)."""
    import json

    path = Path(folder) / "generation_config.json"
    ids = [int(eos_id)]
    if path.is_file():
        try:
            listed = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError) as err:
            raise TokenizerError(f"{path}: not readable JSON: {err}") from err
        listed = [listed] if isinstance(listed, int) else list(listed or [])
        ids += [int(i) for i in listed if int(i) not in ids]
    return tuple(ids)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `.model` file -> SentencePieceTokenizer; a folder -> HFTokenizer."""
    p = Path(path)
    if p.is_dir():
        return HFTokenizer(p)
    if p.suffix == ".model" or p.is_file():
        return SentencePieceTokenizer(p)
    raise TokenizerError(f"tokenizer not found: {p} (expected a .model file or an HF folder)")


def train_sentencepiece(texts: Iterable[str], out_prefix: str | Path, vocab_size: int = 512,
                        seed_sentencepiece_size: int = 100000) -> Path:
    """Train a BPE sentencepiece model that splits digits; returns the `.model` path.

    Deterministic for the same texts. ids: 0 = pad, 1 = bos, 2 = eos, 3 = unk.
    """
    import sentencepiece as spm

    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        split_digits=True,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        byte_fallback=False,
        character_coverage=1.0,
        num_threads=1,
        seed_sentencepiece_size=seed_sentencepiece_size,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path = out_prefix.with_suffix(".model")
    path.write_bytes(model.getvalue())
    return path
