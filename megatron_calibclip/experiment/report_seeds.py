"""The second round's runs: `seed-<n>/<arm>/` folders, which of them are usable, and the
per-run quantities the paired comparison is made of.

Arms of one seed share the data order, so they are compared seed by seed. A run is used only
when it holds every step 0..N-1 (N: the most steps any run has) and nothing in it
contradicts its folder; every other run is listed with the reason it was left out, so that
a report never silently mixes finished and running arms.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_calibclip.experiment.report import WINDOW, heldout, mean_of, values_by_step
from megatron_calibclip.experiment.report_stats import standard_error

SEED_PREFIX = "seed-"
# the arms of the second round, in the order tables and figures show them
SEED_ARMS = ("bf16", "fp8-tis", "fp8-calibrated", "fp8-calibrated-l-only")
HELDOUT_FROM = 30  # held-out accuracy of a run: mean of its evaluations after >= 30 updates


@dataclass
class ArmRun:
    """One arm of one seed as committed: metrics, run_info.json, the samples' line count."""
    seed: int
    arm: str
    folder: Path
    records: list[dict]
    info: dict
    samples: int
    problems: list[str] = field(default_factory=list)  # why it cannot be used, besides steps

    @property
    def steps(self) -> list[int]:
        return sorted(r["step"] for r in self.records)

    @property
    def commit(self) -> str:
        return str(self.info.get("commit") or "n/a")[:10]

    @property
    def minutes(self) -> Optional[float]:
        """Minutes of steps (the sum of time/step): what the run cost, whatever sessions it
        spanned (run_info's segments time only the last resumption)."""
        times = [r["time/step"] for r in self.records if isinstance(r.get("time/step"), (int, float))]
        return math.fsum(times) / 60 if times else None


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """(records, unreadable lines): a copy taken while the arm writes may end mid-line."""
    records, bad = [], 0
    if not path.exists():
        return records, bad
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def load_run(seed: int, folder: Path) -> ArmRun:
    """Read one `seed-<n>/<arm>/` folder and note what contradicts it."""
    records, bad = read_jsonl(folder / "metrics.jsonl")
    records = sorted((r for r in records if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    samples, bad_samples = read_jsonl(folder / "samples.jsonl")
    run = ArmRun(seed, folder.name, folder, records, {}, len(samples))
    if bad:
        run.problems.append(f"{bad} unreadable line(s) in metrics.jsonl")
    if bad_samples:
        run.problems.append(f"{bad_samples} unreadable line(s) in samples.jsonl")
    steps = run.steps
    if len(set(steps)) != len(steps):
        run.problems.append("a step logged twice in metrics.jsonl")
    info_path = folder / "run_info.json"
    if info_path.exists():
        try:
            run.info = json.loads(info_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            run.problems.append("run_info.json unreadable")
        if not isinstance(run.info, dict):
            run.info = {}
            run.problems.append("run_info.json is not a JSON object")
    seed_in_info = run.info.get("seed")
    if seed_in_info is not None and seed_in_info != seed:
        run.problems.append(f"run_info.json says seed {seed_in_info}, folder seed-{seed}")
    return run


@dataclass
class SeedRuns:
    """Every run found under the seed folders, and the step count a complete run has."""
    runs: dict[tuple[int, str], ArmRun]
    target: int
    _quantities: dict = field(default_factory=dict, repr=False)

    def quantities(self, seed: int, arm: str) -> dict[str, Optional[float]]:
        """run_quantities of one run, computed once (every table and the figure read them)."""
        if (seed, arm) not in self._quantities:
            self._quantities[(seed, arm)] = run_quantities(self.runs[(seed, arm)].records, self.target)
        return self._quantities[(seed, arm)]

    def seeds(self) -> list[int]:
        return sorted({s for s, _ in self.runs})

    def arms(self) -> list[str]:
        found = {a for _, a in self.runs}
        return list(SEED_ARMS) + sorted(found - set(SEED_ARMS))

    def why_not(self, seed: int, arm: str) -> Optional[str]:
        """None when the run is used; otherwise the reason it is left out."""
        run = self.runs.get((seed, arm))
        if run is None:
            return "missing"
        if run.problems:
            return "; ".join(run.problems)
        if run.steps != list(range(self.target)):
            return f"{len(run.steps)} of {self.target} steps (incomplete)"
        return None

    def usable(self, arm: str) -> dict[int, ArmRun]:
        """{seed: run} of the complete runs of `arm`."""
        return {s: self.runs[(s, arm)] for s in self.seeds() if self.why_not(s, arm) is None}


def load_seeds(folder: Path) -> Optional[SeedRuns]:
    """The `seed-<n>/<arm>/` runs under `folder`, or None when there is no seed folder."""
    runs = {}
    for seed_dir in sorted(Path(folder).glob(f"{SEED_PREFIX}*")):
        suffix = seed_dir.name[len(SEED_PREFIX):]
        if not seed_dir.is_dir() or not suffix.isdigit():
            continue
        for arm_dir in sorted(p for p in seed_dir.iterdir() if p.is_dir()):
            if any((arm_dir / f).exists() for f in ("metrics.jsonl", "run_info.json", "samples.jsonl")):
                runs[(int(suffix), arm_dir.name)] = load_run(int(suffix), arm_dir)
    if not runs:
        return None
    target = max((r.steps[-1] + 1 for r in runs.values() if r.steps), default=0)
    return SeedRuns(runs, target)


def quantity_labels(target: int) -> dict[str, str]:
    """{quantity: how the tables name it} for runs of `target` steps."""
    early, last = f"steps 0-{WINDOW - 1}", f"steps {WINDOW}-{target - 1}"
    return {
        "reward_last": f"training reward, last {WINDOW} steps",
        "heldout": f"held-out accuracy (BF16), mean after {HELDOUT_FROM}+ updates",
        "phantom_early": f"phantom A<0, {early}",
        "phantom_late": f"phantom A<0, {last}",
        "clipped_early": f"clipped A<0, {early}",
        "clipped_late": f"clipped A<0, {last}",
        "clipped_upper_late": f"clipped A>0 (above H), {last}",
        "lower_late": f"lower bound L in force, {last}",
        "upper_late": f"upper bound H in force, {last}",
        "entropy_last": f"entropy, last {WINDOW} steps",
        "eos_last": f"EOS fraction, last {WINDOW} steps",
        "mismatch": "rollout/trainer mismatch (mult. prob. error), mean of all steps",
        "mismatch_max": "rollout/trainer mismatch (mult. prob. error), largest step",
        "kl_last": f"KL to reference, last {WINDOW} steps",
    }


def heldout_used(records: list[dict]) -> list[float]:
    """The held-out accuracies a run's held-out mean averages: evaluations after HELDOUT_FROM updates."""
    return [acc for updates, acc in heldout(records) if updates >= HELDOUT_FROM]


def run_quantities(records: list[dict], target: int) -> dict[str, Optional[float]]:
    """The quantities of one run (rates over A<0 or A>0 tokens: over the steps that had some)."""
    last = target - WINDOW

    def mean(key: str, lo: int, hi: int) -> Optional[float]:
        return mean_of([p for p in values_by_step(records, key) if lo <= p[0] < hi])

    held = heldout_used(records)
    return {
        "reward_last": mean("reward_mean", last, target),
        "heldout": math.fsum(held) / len(held) if held else None,
        "phantom_early": mean("loss/phantom_clipfrac", 0, WINDOW),
        "phantom_late": mean("loss/phantom_clipfrac", WINDOW, target),
        "clipped_early": mean("loss/clipfrac_lower", 0, WINDOW),
        "clipped_late": mean("loss/clipfrac_lower", WINDOW, target),
        "clipped_upper_late": mean("loss/clipfrac_upper", WINDOW, target),
        "lower_late": mean("clip/lower", WINDOW, target),
        "upper_late": mean("clip/upper", WINDOW, target),
        "entropy_last": mean("loss/entropy_mean", last, target),
        "eos_last": mean("eos_fraction", last, target),
        "mismatch": mean("loss/mult_prob_error", 0, target),
        "mismatch_max": max((v for s, v in values_by_step(records, "loss/mult_prob_error") if s < target),
                            default=None),
        "kl_last": mean("loss/kl_mean", last, target),
    }


def reward_noise(records: list[dict], target: int) -> Optional[float]:
    """Within-run noise of the last-`WINDOW` reward mean: std of the per-step rewards / sqrt(n)."""
    return standard_error([v for s, v in values_by_step(records, "reward_mean") if s >= target - WINDOW])


def heldout_noise(records: list[dict]) -> Optional[float]:
    """Within-run noise of the held-out mean: std of the evaluations after HELDOUT_FROM updates
    / sqrt(their number). Greedy decoding on fixed problems: what moves an evaluation is the
    model between evaluations, as the per-step rewards move within the last 20 steps."""
    return standard_error(heldout_used(records))


def heldout_problems(records: list[dict]) -> Optional[float]:
    """How many problems one held-out evaluation of the run scored."""
    sizes = [r[k] for r in records for k in ("eval/problems", "eval_final/problems")
             if isinstance(r.get(k), (int, float))]
    return float(max(sizes)) if sizes else None


def measurement_noise(records: list[dict], quantity: str, target: int) -> Optional[float]:
    """The within-run noise of one run's value of `quantity`, where it is known; None elsewhere:
    the standard error of the mean it is (std of the values averaged / sqrt(their number), as
    if independent). Last-20 reward: reward_noise; held-out accuracy: heldout_noise."""
    if quantity == "reward_last":
        return reward_noise(records, target)
    if quantity == "heldout":
        return heldout_noise(records)
    return None


NOISE_FLOORED = ("reward_last", "heldout")  # the quantities whose within-run noise is known


def paired_floor(seeds: SeedRuns, quantity: str, arm: str, base: str) -> float:
    """The measurement noise of one per-seed difference arm - base: sqrt(mean over the paired
    seeds of noise(arm)^2 + noise(base)^2); 0 where the noise of a run is not known."""
    terms = []
    for seed in paired(seeds, quantity, arm, base):
        noise = [measurement_noise(seeds.runs[(seed, a)].records, quantity, seeds.target) for a in (arm, base)]
        if None in noise:
            return 0.0
        terms.append(noise[0] ** 2 + noise[1] ** 2)
    return math.sqrt(math.fsum(terms) / len(terms)) if terms else 0.0


def paired(seeds: SeedRuns, quantity: str, arm: str, base: str) -> dict[int, float]:
    """{seed: value(arm) - value(base)} over the seeds where both runs are used and measured."""
    a, b = seeds.usable(arm), seeds.usable(base)
    out = {}
    for seed in sorted(set(a) & set(b)):
        va, vb = seeds.quantities(seed, arm)[quantity], seeds.quantities(seed, base)[quantity]
        if va is not None and vb is not None:
            out[seed] = va - vb
    return out
