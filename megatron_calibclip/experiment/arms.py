"""An experiment file: one base training config, settings shared by every arm, the arms as
overrides of it, and optionally the rounds that ran (or will run) some of the arms with more
settings. Same seed, prompts and hyper-parameters everywhere but what an arm sets.

    base: smollm2-135m-cpu        # bundled train config name or YAML path
    set: {run.steps: 100, ...}    # every arm
    arms:
      bf16: {precision: bf16, rollout.precision: bf16, clipping.mode: fixed}
      ...
    rounds:                       # optional; without it: one round of every arm
      first: {arms: [bf16, ...]}                      # runs/<arm>/, <folder>/<arm>/
      second: {seeded: true, set: {...}, arms: [...]}  # --seed N: runs/seed-N/<arm>/

Why rounds: a later round changes settings (e.g. evaluation.precision) and adds arms, and
the earlier round's configuration must stay what it was, readable and re-runnable.
A seeded round runs every arm once per `--seed N` (run.seed = N), so the arms of one seed
see the same prompts in the same order: they are paired.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_calibclip.config import ConfigError, load_yaml

ARM_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_")
ROUND_KEYS = {"arms", "set", "seeded"}


def seed_root(folder: Path, seed: Optional[int]) -> Path:
    """Where the arms of one seed live under a runs or metrics folder: `folder/seed-N` (a
    round without seeds: `folder` itself); an arm's files are in `seed_root(...) / arm`."""
    return Path(folder) if seed is None else Path(folder) / f"seed-{seed}"


@dataclass(frozen=True)
class Round:
    name: str
    arms: tuple[str, ...]  # arm names, in run order
    shared: dict[str, Any]  # settings of this round, on top of the experiment's `set`
    seeded: bool  # run once per --seed N, in seed-N/ folders


@dataclass(frozen=True)
class Experiment:
    path: Path
    base: str
    shared: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    rounds: dict[str, Round]

    def overrides(self, arm: str, round_: Optional[Round] = None, seed: Optional[int] = None) -> list[str]:
        """`key=value` overrides for `arm` (shared first, then the round's, the arm's own, the
        seed of a seeded round, and run.name = the arm)."""
        if arm not in self.arms:
            raise ConfigError(f"{self.path}: no arm {arm!r} (arms: {', '.join(self.arms)})")
        merged = {**self.shared, **(round_.shared if round_ else {}), **self.arms[arm]}
        if seed is not None:
            merged["run.seed"] = seed
        merged["run.name"] = arm
        return [f"{k}={json.dumps(v)}" for k, v in merged.items()]

    def select_round(self, name: Optional[str] = None, seed: Optional[int] = None) -> Round:
        """The round `name`; by default the last seeded round with a seed, else the first
        round without seeds. A seed is required by a seeded round and refused by the others."""
        if name is not None and name not in self.rounds:
            raise ConfigError(f"{self.path}: no round {name!r} (rounds: {', '.join(self.rounds)})")
        if name is None:
            wanted = [r for r in self.rounds.values() if r.seeded == (seed is not None)]
            if not wanted:
                kind = "seeded round (seeded: true)" if seed is not None else "round without seeds"
                raise ConfigError(f"{self.path}: no {kind}; rounds: {', '.join(self.rounds)}")
            name = (wanted[-1] if seed is not None else wanted[0]).name
        chosen = self.rounds[name]
        if chosen.seeded and seed is None:
            raise ConfigError(f"round {name!r} is seeded: give --seed N (an integer >= 0)")
        if not chosen.seeded and seed is not None:
            raise ConfigError(f"round {name!r} has no seeds (its run.seed is in the file); drop --seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"--seed {seed!r}: must be an integer >= 0")
        return chosen


def _check_overrides(p: Path, where: str, sets: Any) -> dict[str, Any]:
    if not isinstance(sets or {}, dict):
        raise ConfigError(f"{p}: {where} must be a mapping of key.path: value")
    if "run.name" in (sets or {}):
        raise ConfigError(f"{p}: run.name is the arm's name; do not set it ({where})")
    return dict(sets or {})


def _load_rounds(p: Path, data: Any, arms: dict[str, dict[str, Any]]) -> dict[str, Round]:
    if data is None:  # one round of every arm, as before rounds existed
        return {"default": Round("default", tuple(arms), {}, False)}
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{p}: 'rounds' must map round names to {{arms, set, seeded}}")
    rounds = {}
    for name, spec in data.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"{p}: round {name!r} must be a mapping with keys {sorted(ROUND_KEYS)}")
        unknown = set(spec) - ROUND_KEYS
        if unknown:
            raise ConfigError(f"{p}: round {name!r}: unknown key(s) {sorted(unknown)}; allowed: {sorted(ROUND_KEYS)}")
        names, seeded = spec.get("arms"), spec.get("seeded", False)
        if not isinstance(names, list) or not names or not all(isinstance(a, str) for a in names):
            raise ConfigError(f"{p}: round {name!r}: 'arms' must be a non-empty list of arm names")
        missing = [a for a in names if a not in arms]
        if missing:
            raise ConfigError(f"{p}: round {name!r}: no arm(s) {missing} (arms: {', '.join(arms)})")
        if not isinstance(seeded, bool):
            raise ConfigError(f"{p}: round {name!r}: 'seeded' must be true or false, got {seeded!r}")
        shared = _check_overrides(p, f"round {name!r} 'set'", spec.get("set"))
        if seeded and "run.seed" in shared:
            raise ConfigError(f"{p}: round {name!r} is seeded: run.seed comes from --seed; do not set it")
        rounds[str(name)] = Round(str(name), tuple(names), shared, seeded)
    return rounds


def load_experiment(path: str | Path) -> Experiment:
    """Read and check an experiment file (one-line ConfigError for each mistake)."""
    p = Path(path)
    data = load_yaml(p)
    unknown = set(data) - {"base", "set", "arms", "rounds"}
    if unknown:
        raise ConfigError(f"{p}: unknown top-level key(s) {sorted(unknown)}; "
                          f"expected base, set, arms, rounds")
    base, shared, arms = data.get("base"), data.get("set") or {}, data.get("arms")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{p}: 'base' must name a training config (bundled name or YAML)")
    if not isinstance(shared, dict):
        raise ConfigError(f"{p}: 'set' must be a mapping of key.path: value")
    if not isinstance(arms, dict) or not arms:
        raise ConfigError(f"{p}: 'arms' must map arm names to override mappings")
    _check_overrides(p, "'set'", shared)
    for name, sets in arms.items():
        if not isinstance(name, str) or not name or set(name) - ARM_NAME_CHARS:
            raise ConfigError(f"{p}: arm name {name!r}: use lowercase letters, digits, - and _")
        _check_overrides(p, f"arm {name!r}", sets)
    if base.endswith((".yaml", ".yml")) and not Path(base).is_absolute():
        candidate = p.parent / base
        base = str(candidate) if candidate.exists() else base
    arms = {k: dict(v or {}) for k, v in arms.items()}
    return Experiment(p, base, dict(shared), arms, _load_rounds(p, data.get("rounds"), arms))
