"""Prompt sources: JSONL files and reasoning-gym tasks, as one stream of PromptRecords.

Bad data never disappears silently: a record with a missing field or an empty prompt is
either an error naming the file and line (`on_bad="error"`, the default) or a counted skip
(`on_bad="skip"`, see `.skipped`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

OnBad = Literal["error", "skip"]


class DataError(ValueError):
    """A data file or record is unusable; the message says which and why."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: str  # the question shown to the policy (before the template)
    answer: str  # the reference answer the reward compares against
    source: str  # e.g. "file.jsonl:12" or "reasoning_gym:chain_sum:7"
    entry: dict[str, Any] | None = field(default=None, compare=False)  # task-native record


@dataclass
class SkipCounter:
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count

    def add(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        """'3 record(s) skipped (data.on_bad=skip): invalid JSON x2, missing field(s) x1'."""
        ordered = sorted(self.skipped.items(), key=lambda kv: -kv[1])
        reasons = ", ".join(f"{k} x{v}" for k, v in ordered)
        return f"{self.total} record(s) skipped (data.on_bad=skip): {reasons}"


def read_jsonl(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer",
               on_bad: OnBad = "error", skips: SkipCounter | None = None) -> list[PromptRecord]:
    """Records of a JSONL file, one JSON object per line (blank lines ignored)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompt file not found: {p}")
    skips = skips if skips is not None else SkipCounter()
    out: list[PromptRecord] = []

    def bad(line_no: int, reason: str) -> None:
        if on_bad == "error":
            raise DataError(f"{p}:{line_no}: {reason}")
        skips.add(reason.split(":")[0])

    with p.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                bad(line_no, f"invalid JSON: {err.msg}")
                continue
            if not isinstance(obj, dict):
                bad(line_no, "not a JSON object")
                continue
            missing = [k for k in (prompt_key, answer_key) if k not in obj]
            if missing:
                bad(line_no, f"missing field(s): {missing}")
                continue
            prompt, answer = obj[prompt_key], obj[answer_key]
            if not isinstance(prompt, str) or not prompt.strip():
                bad(line_no, f"empty prompt: field {prompt_key!r}")
                continue
            out.append(PromptRecord(prompt, str(answer), f"{p.name}:{line_no}", obj))
    return out


REASONING_GYM_TASKS = ("chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic", "products")


def reasoning_gym_records(task: str, size: int, seed: int, **task_config: Any
                          ) -> list[PromptRecord]:
    """`size` procedurally generated problems of a reasoning-gym task (offline, seeded)."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise DataError("reasoning-gym tasks need the `tasks` extra "
                        "(pip install -e .[tasks])") from err
    try:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    except (KeyError, ValueError, TypeError) as err:
        raise DataError(f"reasoning-gym task {task!r} with {task_config}: {err}") from err
    return [
        PromptRecord(e["question"], str(e["answer"]), f"reasoning_gym:{task}:{i}", dict(e))
        for i, e in enumerate(ds)
    ]
