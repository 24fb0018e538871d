"""An experiment file: one base training config, settings shared by every arm, and the arms
as overrides of it. Same seed, prompts and hyper-parameters everywhere but what an arm sets.

    base: smollm2-135m-cpu        # bundled train config name or YAML path
    set: {run.steps: 100, ...}    # every arm
    arms:
      bf16: {precision: bf16, rollout.precision: bf16, clipping.mode: fixed}
      ...
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_calibclip.config import ConfigError, load_yaml

ARM_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_")


@dataclass(frozen=True)
class Experiment:
    path: Path
    base: str
    shared: dict[str, Any]
    arms: dict[str, dict[str, Any]]

    def overrides(self, arm: str) -> list[str]:
        """`key=value` overrides for `arm` (shared first, the arm's own last)."""
        if arm not in self.arms:
            raise ConfigError(f"{self.path}: no arm {arm!r} (arms: {', '.join(self.arms)})")
        merged = {**self.shared, **self.arms[arm], "run.name": arm}
        return [f"{k}={json.dumps(v)}" for k, v in merged.items()]


def load_experiment(path: str | Path) -> Experiment:
    """Read and check an experiment file (one-line ConfigError for each mistake)."""
    p = Path(path)
    data = load_yaml(p)
    unknown = set(data) - {"base", "set", "arms"}
    if unknown:
        raise ConfigError(f"{p}: unknown top-level key(s) {sorted(unknown)}; "
                          f"expected base, set, arms")
    base, shared, arms = data.get("base"), data.get("set") or {}, data.get("arms")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{p}: 'base' must name a training config (bundled name or YAML)")
    if not isinstance(shared, dict):
        raise ConfigError(f"{p}: 'set' must be a mapping of key.path: value")
    if not isinstance(arms, dict) or not arms:
        raise ConfigError(f"{p}: 'arms' must map arm names to override mappings")
    for name, sets in arms.items():
        if not isinstance(name, str) or not name or set(name) - ARM_NAME_CHARS:
            raise ConfigError(f"{p}: arm name {name!r}: use lowercase letters, digits, - and _")
        if not isinstance(sets or {}, dict):
            raise ConfigError(f"{p}: arm {name!r} must be a mapping of key.path: value")
        if "run.name" in (sets or {}) or "run.name" in shared:
            raise ConfigError(f"{p}: run.name is the arm's name; do not set it")
    if base.endswith((".yaml", ".yml")) and not Path(base).is_absolute():
        candidate = p.parent / base
        base = str(candidate) if candidate.exists() else base
    return Experiment(p, base, dict(shared), {k: dict(v or {}) for k, v in arms.items()})
