"""Prompt sources, templates, tokenizers and resumable prompt batches (floor 1)."""
from megatron_calibclip.data.dataset import PromptDataset, TokenizedPrompt
from megatron_calibclip.data.sources import (
    REASONING_GYM_TASKS,
    DataError,
    PromptRecord,
    SkipCounter,
    read_jsonl,
    reasoning_gym_records,
)
from megatron_calibclip.data.template import PromptTemplate
from megatron_calibclip.data.tokenizers import (
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "REASONING_GYM_TASKS", "DataError", "HFTokenizer", "PromptDataset", "PromptRecord",
    "PromptTemplate", "SentencePieceTokenizer", "SkipCounter", "TokenizedPrompt", "Tokenizer",
    "TokenizerError", "load_tokenizer", "read_jsonl", "reasoning_gym_records",
    "train_sentencepiece",
]
