"""A distributed checkpoint -> a Hugging Face safetensors folder, in one process.

Why without a model or a process group: megatron's torch_dist files hold every tensor as one
global array (layers stacked on dim 0, TP shards joined), so the mapping table can be applied
to them directly, whatever TP/PP the checkpoint was saved at. torch.distributed.checkpoint
reads one key at a time, so memory peaks at one stacked tensor plus the output.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_calibclip.checkpoint import mapping
from megatron_calibclip.checkpoint.errors import CheckpointError, ConversionError
from megatron_calibclip.checkpoint.hf_config import hf_config_from_model_config, hf_dtype
from megatron_calibclip.checkpoint.hf_io import (
    begin_output,
    discard_output,
    finish_output,
    write_safetensors_folder,
)
from megatron_calibclip.checkpoint.hf_to_mcore import HF_ASSETS_DIR
from megatron_calibclip.checkpoint.info import CheckpointInfo
from megatron_calibclip.checkpoint.layout import resolve_checkpoint
from megatron_calibclip.checkpoint.progress import progress as progress_bar
from megatron_calibclip.parallel.devices import HOST

# Tensor keys of a checkpoint that are not model weights.
_NON_MODEL_PREFIXES = ("optimizer.",)


class CheckpointTensors:
    """Global (unsharded) tensors of a torch_dist checkpoint, read on demand."""

    def __init__(self, folder: Path, other_prefixes: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.skip = _NON_MODEL_PREFIXES + other_prefixes  # optimizer, frozen models
        self.reader = dcp.FileSystemReader(str(folder))
        try:
            metadata = self.reader.read_metadata()
        except Exception as err:  # noqa: BLE001 - missing/corrupt .metadata
            raise CheckpointError(f"{folder}: cannot read the torch_dist metadata: {err}") from err
        self.meta = {k: v for k, v in metadata.state_dict_metadata.items()
                     if isinstance(v, TensorStorageMetadata)}

    @property
    def model_keys(self) -> set[str]:
        return {k for k in self.meta if not k.startswith(self.skip)}

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.meta[key].size)

    def get(self, key: str) -> torch.Tensor:
        md = self.meta[key]
        # conversion is offline and reads into host memory
        out = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype, device=HOST)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(out, storage_reader=self.reader, no_dist=True)
        return out[key]


def _check_keys(tensors: CheckpointTensors, entries: list[mapping.Entry], cfg) -> None:
    expected: dict[str, tuple[int, ...]] = {}
    for e in entries:
        stacked = e.mcore_shape if e.layer is None else (cfg.num_layers, *e.mcore_shape)
        expected[e.stacked_key] = stacked
    present = tensors.model_keys
    missing = sorted(set(expected) - present)
    if missing:
        raise ConversionError(f"{tensors.folder}: missing tensor {missing[0]!r} (needed for a "
                              f"{cfg.family} model; {len(missing)} missing)")
    extra = sorted(present - set(expected))
    if extra:
        raise ConversionError(f"{tensors.folder}: unexpected tensor {extra[0]!r}: not part of "
                              f"a {cfg.family} model with the saved config")
    for key, shape in expected.items():
        got = tensors.shape(key)
        vocab_ok = key in mapping.VOCAB_NAMES and got[1:] == shape[1:] and got[0] >= shape[0]
        if got != shape and not vocab_ok:
            raise ConversionError(f"{tensors.folder}: tensor {key!r} has shape {list(got)}, "
                                  f"expected {list(shape)} from the saved model config")


def convert_mcore_to_hf(
    ckpt: os.PathLike | str,
    out_dir: os.PathLike | str,
    *,
    dtype: Optional[torch.dtype] = None,
    progress: bool = False,
) -> Path:
    """Write an HF folder from a checkpoint folder (or a root with `latest`).

    config.json and tokenizer files come from the checkpoint's hf/ folder when it was made by
    hf-to-mcore, else config.json is generated from the saved ModelConfig. dtype: of the
    written weights (default: the HF config's dtype, else float32). progress: a bar over
    the checkpoint's tensors on stderr.
    """
    out = Path(out_dir)
    partial = begin_output(out)
    folder = resolve_checkpoint(ckpt)
    info = CheckpointInfo.read(folder)
    cfg = info.model()
    if cfg is None:
        raise ConversionError(f"{folder}: the checkpoint records no model config")
    assets_dir = folder / HF_ASSETS_DIR
    if (assets_dir / "config.json").exists():
        hf_config = json.loads((assets_dir / "config.json").read_text(encoding="utf-8"))
        assets = sorted(p for p in assets_dir.iterdir() if p.is_file())
    else:
        hf_config = hf_config_from_model_config(cfg, dtype or torch.float32)
        assets = []
    out_dtype = dtype or hf_dtype(hf_config)
    if out_dtype != hf_dtype(hf_config):  # --dtype overrides: config.json must say so
        name = str(out_dtype).removeprefix("torch.")
        hf_config = dict(hf_config, dtype=name)
        if "torch_dtype" in hf_config:
            hf_config["torch_dtype"] = name
        assets = [p for p in assets if p.name != "config.json"]

    frozen = tuple(f"{c.split(':', 1)[1]}." for c in info.contents if c.startswith("frozen:"))
    tensors = CheckpointTensors(folder, frozen)
    entries = mapping.resolve(cfg)
    _check_keys(tensors, entries, cfg)
    by_key: dict[str, list[mapping.Entry]] = {}
    for e in entries:
        by_key.setdefault(e.stacked_key, []).append(e)
    hf_tensors: dict[str, torch.Tensor] = {}
    for key, group in progress_bar(by_key.items(), enabled=progress,
                                   desc=f"reading {folder.name}"):
        value = tensors.get(key)
        for e in group:
            t = value if e.layer is None else value[e.layer]
            if key in mapping.VOCAB_NAMES:
                t = t[: cfg.vocab_size]
            for name, h in e.to_hf(cfg, t).items():
                hf_tensors[name] = h.to(out_dtype).clone()
        del value
    try:
        has_config = any(p.name == "config.json" for p in assets)  # keep it byte-identical
        write_safetensors_folder(partial, hf_tensors, None if has_config else hf_config,
                                 assets=assets)
        return finish_output(partial, out)
    except BaseException:
        discard_output(partial)
        raise
