"""Guard a run directory before a run writes into it: never lose results unless asked.

A run directory holds results when it has metrics or a checkpoint. Writing a new run there
would cut metrics.jsonl, replace config.yaml and summary.png and leave old checkpoints
beside them (a later resume would mix two runs). So a directory with results is only
reused by a run with the same configuration (a resume, or a continuation with more
`run.steps`); anything else is refused with one line, unless `run.overwrite` is set,
which clears the directory first. Fields that do not change what the run computes
(`IGNORED`) may differ.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_calibclip.config import to_dict

# may differ between a run and its continuation: how long, how often to save, what to show
IGNORED = {"run.steps", "run.progress", "run.tensorboard", "run.plot", "run.save_every",
           "run.checkpoint", "run.keep_checkpoints", "run.overwrite", "run.output_dir",
           "clipping.calibration.record_dir", "samples.every", "samples.count"}


class RunDirError(RuntimeError):
    """The run directory holds results that this run would overwrite; the message says how
    to proceed."""


@dataclass
class RunDirState:
    path: Path
    metrics_records: int  # lines in metrics.jsonl
    has_checkpoint: bool  # checkpoints/latest exists


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def config_differences(saved: dict, current: dict) -> list[str]:
    """Dotted keys, present in both, whose values differ (IGNORED keys left out). Keys only
    one side has (fields added or removed by an upgrade) are not differences."""
    a, b = _flatten(saved), _flatten(current)
    return sorted(k for k in a.keys() & b.keys() if k not in IGNORED and a[k] != b[k])


def inspect(path: Path) -> RunDirState:
    metrics = path / "metrics.jsonl"
    n = 0
    if metrics.is_file():
        with metrics.open(encoding="utf-8") as fh:
            n = sum(1 for line in fh if line.strip())
    return RunDirState(path, n, (path / "checkpoints" / "latest").is_file())


def check_run_dir(path: Path, cfg: Any, has_checkpoint: bool | None = None) -> RunDirState:
    """Raise RunDirError if running `cfg` in `path` would overwrite another run's results;
    with `cfg.run.overwrite`, clear `path` instead. Call on one rank, before writing.
    `has_checkpoint`: whether the run's checkpointer can resume (None: look for
    path/checkpoints/latest, the trainer's own checkpointer)."""
    path = Path(path)
    state = inspect(path)
    if has_checkpoint is not None:
        state.has_checkpoint = has_checkpoint
    if not path.exists() or (state.metrics_records == 0 and not state.has_checkpoint):
        return state
    where = f"run directory {path}"
    if cfg.run.overwrite:
        shutil.rmtree(path)
        return inspect(path)
    how = "choose another run.name (or run.output_dir), or --set run.overwrite=true to replace it"
    saved_file = path / "config.yaml"
    if saved_file.is_file():
        try:
            saved = yaml.safe_load(saved_file.read_text()) or {}
        except yaml.YAMLError:
            saved = None
        current = yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        if not isinstance(saved, dict):
            raise RunDirError(f"{where} holds results but its config.yaml is unreadable; {how}")
        diff = config_differences(saved, current)
        if diff:
            before, after = _flatten(saved), _flatten(current)
            shown = ", ".join(f"{k} ({_short(before[k])} -> {_short(after[k])})" for k in diff[:4])
            more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
            raise RunDirError(f"{where} holds a run with another configuration "
                              f"(differs in {shown}{more}); {how}")
    held = f"{where} holds {state.metrics_records} steps of metrics"
    if not cfg.run.checkpoint:
        raise RunDirError(f"{held} and run.checkpoint is false, so this run would start over "
                          f"and replace them; {how}")
    if not state.has_checkpoint:
        raise RunDirError(f"{held} but no checkpoint to resume from; {how}")
    return state


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
