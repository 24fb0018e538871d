"""Distributed checkpoints (save/load/resume/preemption) and HF <-> Megatron conversion (floor 3).

Training side: CheckpointManager (atomic torch_dist checkpoints with optimizer, RNG, calibration
state and data cursor; loads at any TP/PP/DP), TrainerCheckpointer (it, behind the trainer's
Checkpointer seam) and PreemptionHandler (SIGTERM/SIGUSR1 -> save -> exit EXIT_PREEMPTED).
Conversion side: convert_hf_to_mcore / convert_mcore_to_hf over the declarative table in
mapping.py, gguf_to_hf, break_bf16_ties. See docs/checkpoints.md.

Names are imported on first use, so that `calibclip --help` (which imports checkpoint.cli)
does not pay for megatron-core, safetensors or transformers.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "errors",
    "ConversionError": "errors",
    "DamagedCheckpointError": "errors",
    "CheckpointInfo": "info",
    "ParallelSizes": "info",
    "CheckpointManager": "manager",
    "LoadedCheckpoint": "manager",
    "Stateful": "manager",
    "load_weights": "manager",
    "EXIT_PREEMPTED": "preemption",
    "PreemptionHandler": "preemption",
    "TrainerCheckpointer": "trainer_seam",
    "convert_hf_to_mcore": "hf_to_mcore",
    "load_hf_into_model": "hf_to_mcore",
    "convert_mcore_to_hf": "mcore_to_hf",
    "gguf_to_hf": "gguf",
    "smollm2_gguf_path": "gguf",
    "break_bf16_ties": "ties",
    "model_config_from_hf": "hf_config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
