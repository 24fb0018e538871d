"""Hugging Face folder -> megatron model shards -> a distributed checkpoint (at any TP/PP).

Why through a real model: every rank builds its megatron stage, fills its own shard from the
declarative mapping (mapping.py) with the same slicing as the layout-independent init
(models/init.py), and saves with CheckpointManager, so the output is exactly a training
checkpoint (loadable by `CheckpointManager.load` at any other layout) and megatron itself
decides the checkpoint keys.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_calibclip.checkpoint import mapping
from megatron_calibclip.checkpoint.errors import ConversionError
from megatron_calibclip.checkpoint.hf_config import model_config_from_hf, read_hf_config
from megatron_calibclip.checkpoint.hf_io import (
    SafetensorsFolder,
    discard_output,
    finish_output,
    hf_asset_files,
)
from megatron_calibclip.checkpoint.manager import CheckpointManager, unwrap_model
from megatron_calibclip.checkpoint.progress import progress as progress_bar
from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.models.init import global_param_name, shard_of
from megatron_calibclip.parallel.flags import any_rank

HF_ASSETS_DIR = "hf"  # inside a converted checkpoint folder: config.json, tokenizer files


def _describe_dims(cfg: ModelConfig) -> str:
    d = mapping.dims(cfg)
    return (f"hidden_size={d['hidden']}, intermediate_size={d['ffn']}, vocab_size={d['vocab']}, "
            f"num_attention_heads={cfg.num_attention_heads}, "
            f"num_key_value_heads={cfg.num_query_groups}, head_dim={d['head_dim']}")


class HFSource:
    """A validated HF folder that yields whole megatron tensors by (layered) megatron name."""

    def __init__(self, folder: os.PathLike | str, make_vocab_size_divisible_by: int = 128) -> None:
        self.folder = Path(folder)
        self.hf_config = read_hf_config(self.folder)
        self.cfg = model_config_from_hf(self.hf_config, str(self.folder / "config.json"),
                                        make_vocab_size_divisible_by)
        self.reader = SafetensorsFolder(self.folder)
        self.entries = {e.mcore: e for e in mapping.resolve(self.cfg)}
        self._validate()

    def _validate(self) -> None:
        """Every expected tensor present with its shape, nothing unexplained left over."""
        cfg, reader = self.cfg, self.reader
        expected: dict[str, tuple[int, ...]] = {}
        for e in self.entries.values():
            expected.update(zip(e.hf, e.hf_shapes))
        missing = sorted(set(expected) - reader.names)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConversionError(f"missing tensor {missing[0]!r} in {self.folder}{more}: the "
                                  f"{cfg.family} mapping needs it")
        extra = sorted(n for n in reader.names - set(expected)
                       if not n.endswith(mapping.IGNORED_HF_SUFFIXES))
        if cfg.tie_embeddings and "lm_head.weight" in extra:  # tied copy saved explicitly
            if not torch.equal(reader.get("lm_head.weight"),
                               reader.get("model.embed_tokens.weight")):
                raise ConversionError(f"{reader.tensors['lm_head.weight'].file}: "
                                      f"tie_word_embeddings is true but lm_head.weight differs "
                                      f"from model.embed_tokens.weight")
            extra.remove("lm_head.weight")
        if extra:
            raise ConversionError(f"unexpected tensor {extra[0]!r} in "
                                  f"{reader.tensors[extra[0]].file} (not part of a {cfg.family} "
                                  f"model with this config.json; {len(extra)} unexpected)")
        for name, shape in expected.items():
            info = reader.tensors[name]
            if info.shape != shape:
                raise ConversionError(f"tensor {name!r} in {info.file} has shape "
                                      f"{list(info.shape)}, expected {list(shape)} from "
                                      f"config.json ({_describe_dims(cfg)})")
            if not info.dtype.is_floating_point:
                raise ConversionError(f"tensor {name!r} in {info.file} has dtype {info.dtype}, "
                                      f"expected a floating-point type")

    def tensor(self, mcore_name: str) -> torch.Tensor:
        """The whole megatron tensor `mcore_name` (true vocabulary rows, not TP-padded)."""
        e = self.entries[mcore_name]
        return e.to_mcore(self.cfg, [self.reader.get(n) for n in e.hf])


@torch.no_grad()
def load_hf_into_model(model: torch.nn.Module, source: HFSource, *,
                       progress: bool = False) -> None:
    """Fill this rank's stage/shard of `model` (built from source.cfg) from the HF weights.

    progress: draw a bar of this rank's parameters (the caller enables it on one rank)."""
    model = unwrap_model(model)
    cfg = source.cfg
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    params = list(model.named_parameters())
    for local_name, param in progress_bar(params, enabled=progress,
                                          desc=f"reading {source.folder.name}"):
        name = mapping.local_to_checkpoint_name(global_param_name(local_name, cfg))
        if name not in source.entries:
            raise ConversionError(f"model parameter {local_name!r} ({name}) has no Hugging Face "
                                  f"mapping")
        full = source.tensor(name)
        sharded = getattr(param, "tensor_model_parallel", False) and tp > 1
        if name in mapping.VOCAB_NAMES:  # zero rows up to the TP-padded vocabulary
            rows = param.shape[0] * (tp if sharded else 1)
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        if sharded:
            full = shard_of(full, param.partition_dim, getattr(param, "partition_stride", 1),
                            tp_rank, tp)
        if tuple(full.shape) != tuple(param.shape):
            raise ConversionError(f"{name}: mapped shard has shape {list(full.shape)}, the model "
                                  f"parameter {local_name!r} has {list(param.shape)}")
        param.copy_(full.to(param.dtype))


def _all_ok(ok: bool) -> bool:
    """Collective: True if every rank is ok (so that all ranks raise together, none hangs)."""
    return not any_rank(not ok)


def convert_hf_to_mcore(
    hf_dir: os.PathLike | str,
    out_dir: os.PathLike | str,
    *,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    progress: bool = False,
) -> Path:
    """Write OUT_DIR as a checkpoint root (latest -> step_00000000) from an HF folder.

    Collective: call on every rank of an initialised model-parallel world (its TP/PP is the
    layout written). The HF config and tokenizer files go to step_00000000/hf/. OUT_DIR must
    not exist; it appears only when complete. progress: a bar on rank 0 (its own stage) and
    a line when the checkpoint write starts.
    """
    from megatron_calibclip.models.builder import build_gpt_model

    out = Path(out_dir)
    if out.exists():  # every rank checks before any collective, so all fail alike
        raise ConversionError(f"output folder {out} already exists; choose a new path or "
                              f"remove it")
    partial = out.parent / f".{out.name}.partial"
    if dist.get_rank() == 0:
        discard_output(partial)  # left by an earlier, killed conversion
    dist.barrier()
    try:
        error: Optional[BaseException] = None
        try:
            source = HFSource(hf_dir, make_vocab_size_divisible_by)
            # zeros: cheap, and (unlike perform_initialization=False) megatron still sets
            # the TP attributes (partition_dim, stride) that the filling relies on
            model = build_gpt_model(source.cfg, params_dtype=params_dtype,
                                    init_method=torch.nn.init.zeros_,
                                    output_layer_init_method=torch.nn.init.zeros_)
            load_hf_into_model(model, source, progress=progress and dist.get_rank() == 0)
        except Exception as err:  # noqa: BLE001 - agreed across ranks, then re-raised
            error = err
        if not _all_ok(error is None):
            raise error if error is not None else ConversionError(
                "conversion failed on another rank (see its error)")
        if progress and dist.get_rank() == 0:
            print(f"writing the Megatron checkpoint to {out} ...", file=sys.stderr, flush=True)
        step_dir = CheckpointManager(partial, strategy="auto").save(0, model)
        if dist.get_rank() == 0:
            try:
                assets = step_dir / HF_ASSETS_DIR
                assets.mkdir()
                for f in hf_asset_files(source.folder):
                    shutil.copy2(f, assets / f.name)
                finish_output(partial, out)
            except Exception as err:  # noqa: BLE001 - agreed across ranks, then re-raised
                error = err
        if not _all_ok(error is None):
            raise error if error is not None else ConversionError(
                "rank 0 could not finish the output folder (see its error)")
        return out
    except BaseException:
        if dist.get_rank() == 0:
            discard_output(partial)
        raise
