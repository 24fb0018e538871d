"""Response samples of chosen steps, per arm: what "degraded outputs" look like, readable.

Each used run's `samples.jsonl` holds a few decoded responses per step (step, prompt,
response, reward, advantage, eos). The report shows the first few of each chosen step and
arm, in file order, so the same command always shows the same samples.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_calibclip.experiment.report import ranges
from megatron_calibclip.experiment.report_paired import number
from megatron_calibclip.experiment.report_seeds import SeedRuns, read_jsonl

MAX_CHARS = 160  # longer prompts and responses are cut (the table is for reading)


class SamplesError(ValueError):
    """A request the committed samples cannot answer (one line, for exit code 2)."""


def parse_steps(text: str) -> list[int]:
    """'0,50,99' -> [0, 50, 99]; SamplesError for anything else."""
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SamplesError(f"--samples-at takes steps separated by commas (e.g. 0,50,99), "
                           f"got {text!r}") from None
    if not steps or min(steps) < 0:
        raise SamplesError(f"--samples-at takes steps >= 0 separated by commas, got {text!r}")
    return sorted(set(steps))


def read_samples(run_folder: Path) -> list[dict]:
    """The readable records of a run's samples.jsonl (a run still writing may end mid-line)."""
    records, _ = read_jsonl(Path(run_folder) / "samples.jsonl")
    return [r for r in records if isinstance(r.get("step"), int)]


def _cell(text: object) -> str:
    """Markdown-safe, one line, cut at MAX_CHARS (chat markers like <|im_end|> stay visible)."""
    s = str(text)
    s = s if len(s) <= MAX_CHARS else s[:MAX_CHARS] + "..."
    for a, b in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("\r", ""),
                 ("\n", " \u23ce ")):
        s = s.replace(a, b)
    return s


def choose(seeds: SeedRuns, seed: Optional[int], steps: Optional[list[int]]
           ) -> tuple[int, list[int], dict[str, list[dict]]]:
    """(seed, steps, {arm: samples}) for the request; defaults: the lowest seed with samples,
    its first, middle and last sampled steps. SamplesError when the request cannot be met."""
    with_samples: dict[int, dict[str, list[dict]]] = {}
    for s in seeds.seeds():
        for arm in seeds.arms():
            run = seeds.usable(arm).get(s)
            recs = read_samples(run.folder) if run is not None else []
            if recs:
                with_samples.setdefault(s, {})[arm] = recs
    available = sorted(with_samples)
    if seed is None:
        if not available:
            raise SamplesError("no used run has a samples.jsonl")
        seed = available[0]
    if seed not in available:
        raise SamplesError(f"no samples in seed-{seed} (used runs with samples: seeds "
                           f"{ranges(available)})")
    arms = with_samples[seed]
    sampled = sorted({rec["step"] for recs in arms.values() for rec in recs})
    if steps is None:
        middle = min(sampled, key=lambda s: (abs(s - (sampled[0] + sampled[-1]) / 2), -s))
        steps = sorted({sampled[0], middle, sampled[-1]})
    missing = [s for s in steps if s not in sampled]
    if missing:
        raise SamplesError(f"no samples at step(s) {', '.join(map(str, missing))} in seed-{seed} "
                           f"(sampled steps: {ranges(sampled)})")
    return seed, steps, arms


def samples_markdown(seed: int, steps: list[int], arms: dict[str, list[dict]], per_arm: int) -> str:
    """Markdown: for each step, a table of the first `per_arm` samples of every arm."""
    parts = []
    for step in steps:
        rows = [f"**Step {step}** (seed {seed}; the first {per_arm} sample(s) of the step per arm)", "",
                "| arm | reward | advantage | EOS | prompt | response |", "|---|---|---|---|---|---|"]
        for arm, recs in arms.items():
            chosen = [r for r in recs if r["step"] == step][:per_arm]
            if not chosen:
                rows.append(f"| {arm} | | | | | (no samples at this step) |")
            for r in chosen:
                eos = {True: "yes", False: "no"}.get(r.get("eos"), "n/a")
                rows.append(f"| {arm} | {number(r.get('reward'))} | {number(r.get('advantage'), sign=True)} | {eos} "
                            f"| {_cell(r.get('prompt', ''))} | {_cell(r.get('response', ''))} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts)
