"""Decoded responses in the run directory (`samples.jsonl`): what the outputs look like.

Why: reward, entropy and the EOS fraction say that outputs changed, not how ("degraded
outputs" could not be checked in the first reproduction). A few responses per step, decoded
with the run's tokenizer and kept with their reward and advantage, let a reader look. Rank 0
writes them from its own share of the batch (the first data-parallel rank's prompts), so no
collective is added; decoding touches no random state, so training is unchanged.

One JSON object per line: {"step", "group", "sample", "prompt", "response", "reward",
"advantage", "eos", "length"} (docs/trainer.md, "Outputs").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, TextIO

SAMPLES_FILE = "samples.jsonl"


def pick(n_sequences: int, group_size: int, count: int) -> list[int]:
    """Indices of `count` sequences, round-robin over the groups (the first answer of every
    prompt, then the second, ...): several prompts, and the spread within a group."""
    groups = max(n_sequences // group_size, 1)
    order = [g * group_size + j for j in range(group_size) for g in range(groups)]
    return [i for i in order if i < n_sequences][:count]


def sample_records(step: int, data: Any, tokenizer: Any, group_size: int, count: int) -> list[dict[str, Any]]:
    """The picked sequences of one step's data (trainer.step.StepData) as JSON-ready records."""
    b = data.batch
    out = []
    for i in pick(b.batch_size, group_size, count):
        n_prompt, n_resp = int(b.prompt_lengths[i]), int(b.response_lengths[i])
        prompt = b.tokens[i, b.prompt_width - n_prompt: b.prompt_width].tolist()
        response = b.tokens[i, b.prompt_width: b.prompt_width + n_resp].tolist()
        out.append({"step": step, "group": i // group_size, "sample": i % group_size,
                    "prompt": tokenizer.decode(prompt), "response": tokenizer.decode(response),
                    "reward": float(data.rewards[i]), "advantage": float(data.advantages[i]),
                    "eos": bool(b.finished[i]), "length": n_resp})
    return out


class SampleWriter:
    """Appends the samples of every `every`-th step to run_dir/samples.jsonl (rank 0 only).

    A resumed run keeps the lines of the steps before the resume point and drops later ones
    (a crash may have written steps that the checkpoint does not contain), as metrics.jsonl.
    """

    def __init__(self, run_dir: Path, *, every: int, count: int, group_size: int, enabled: bool,
                 start_step: int = 0) -> None:
        self.every, self.count, self.group_size = every, count, group_size
        self.path = Path(run_dir) / SAMPLES_FILE
        self._fh: Optional[TextIO] = None
        if not (enabled and every > 0):
            return
        kept = []
        if start_step > 0 and self.path.exists():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", -1) < start_step]
        self._fh = self.path.open("w", encoding="utf-8")
        self._fh.writelines(line + "\n" for line in kept)
        self._fh.flush()

    def due(self, step: int) -> bool:
        """Whether this rank writes samples of `step`."""
        return self._fh is not None and step % self.every == 0

    def write(self, step: int, data: Any, tokenizer: Any) -> None:
        for record in sample_records(step, data, tokenizer, self.group_size, self.count):
            self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
