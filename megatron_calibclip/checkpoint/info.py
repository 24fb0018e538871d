"""calibclip.json: what a checkpoint holds, readable without torch.distributed or megatron.

Why a sidecar next to megatron's files: conversion back to Hugging Face, `resume` decisions
(same layout -> restore RNG) and humans need the step, the parallel layout and the model
architecture without loading any tensor.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_calibclip.checkpoint.errors import CheckpointError
from megatron_calibclip.models.config import ModelConfig

INFO_FILE = "calibclip.json"
FORMAT = "megatron_calibclip.checkpoint/1"


@dataclass(frozen=True)
class ParallelSizes:
    tp: int  # tensor-parallel size at save time
    pp: int  # pipeline-parallel size at save time
    dp: int  # data-parallel size at save time
    world: int  # number of ranks that saved

    @classmethod
    def current(cls) -> "ParallelSizes":
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        return cls(tp=ps.get_tensor_model_parallel_world_size(),
                   pp=ps.get_pipeline_model_parallel_world_size(),
                   dp=ps.get_data_parallel_world_size(),
                   world=dist.get_world_size())


@dataclass(frozen=True)
class CheckpointInfo:
    step: int  # training steps completed when saved (resume runs step `step` next)
    layout: ParallelSizes  # parallel layout of the ranks that saved
    contents: tuple[str, ...]  # parts saved: model, optimizer, rng, extra_state, stateful:<name>
    model_config: Optional[dict[str, Any]] = None  # ModelConfig as a dict, if the model had one
    format: str = FORMAT  # version of this layout
    megatron_core: str = ""  # megatron-core version that wrote the sharded files
    saved_at: float = field(default_factory=time.time)  # UNIX time of the save
    # how the optimizer state was written (checkpoint/optimizer_format.py): "plain",
    # "dp_reshardable", ...; None: no optimizer state, or written before the field existed
    # (then fully_reshardable, the only format written before the field)
    optimizer_format: Optional[str] = None

    def model(self) -> Optional[ModelConfig]:
        return None if self.model_config is None else ModelConfig(**self.model_config)

    def write(self, folder: Path) -> None:
        data = dataclasses.asdict(self)
        data["contents"] = list(self.contents)
        with open(folder / INFO_FILE, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, folder: Path) -> "CheckpointInfo":
        path = Path(folder) / INFO_FILE
        if not path.exists():
            raise CheckpointError(f"{folder} has no {INFO_FILE}: not a calibclip checkpoint "
                                  f"(or an interrupted save)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT:
                raise CheckpointError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
            data["layout"] = ParallelSizes(**data["layout"])
            data["contents"] = tuple(data["contents"])
            return cls(**data)
        except (ValueError, TypeError, KeyError) as err:
            raise CheckpointError(f"{path} is unreadable: {err}") from err
