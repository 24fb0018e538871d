"""What the second round's calibrated runs rest on: each calibration, whether it took effect,
how many BF16-clipped A<0 tokens its L* was read from, and why the others fell back.

L* is the k-th smallest FP8 ratio over the A<0 tokens, k the tokens the BF16 shadow clips. At
this experiment's batch k is a handful (docs/calibration.md, "Pooling calibrations"): with
k = 1, L* is the smallest FP8 ratio of one step, and one such calibration can set the bounds
of a whole run. A reading of the calibrated arms has to say so with numbers, hence this table.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from megatron_calibclip.experiment.report_paired import number, plural
from megatron_calibclip.experiment.report_seeds import SeedRuns


@dataclass(frozen=True)
class Calibration:
    """One step on which the clipper ran a calibration (scheduled or retried)."""
    step: int
    reason: str  # the fallback's reason code; "" when the calibration took effect
    clipped: Optional[int]  # A<0 tokens the BF16 shadow clipped (k)
    negatives: Optional[int]  # A<0 tokens of the step (n)
    lower_star: Optional[float]  # L* as solved (before widen-only and smoothing)

    @property
    def took_effect(self) -> bool:
        return not self.reason


def _count(record: dict, key: str) -> Optional[int]:
    value = record.get(key)
    return int(value) if isinstance(value, (int, float)) else None


def calibrations(records: list[dict]) -> list[Calibration]:
    """The calibrations of one run, in step order, from its metrics records."""
    out = []
    for r in sorted(records, key=lambda r: r["step"]):
        if not r.get("calib/ran"):
            continue
        reason = str(r.get("calib/fallback_reason") or "").split(":")[0].strip()
        if r.get("calib/fallback") and not reason:
            reason = "unknown"
        lower = r.get("calib/lower_raw")
        out.append(Calibration(int(r["step"]), reason, _count(r, "calib/n_neg_clipped_shadow"),
                               _count(r, "calib/n_neg"),
                               float(lower) if isinstance(lower, (int, float)) else None))
    return out


def _effect_cell(cals: list[Calibration]) -> str:
    done = [c for c in cals if c.took_effect]
    if not done:
        return "none"
    return "; ".join(f"step {c.step}: {c.clipped} of {c.negatives}, L* {number(c.lower_star)}" for c in done)


def _fallback_cell(cals: list[Calibration]) -> str:
    reasons = Counter(c.reason for c in cals if not c.took_effect)
    if not reasons:
        return "none"
    return f"{sum(reasons.values())}: " + ", ".join(f"{code} {n}" for code, n in sorted(reasons.items()))


def calibration_table(seeds: SeedRuns) -> str:
    """Markdown: per used calibrated run its calibrations, then what the effective ones rest on."""
    rows = ["| seed | arm | calibrations | took effect (step: BF16-clipped of A<0 tokens, L*) | "
            "fell back | L, H in force at the last step |", "|---|---|---|---|---|---|"]
    effective: list[Calibration] = []
    for arm in seeds.arms():
        for seed, run in sorted(seeds.usable(arm).items()):
            cals = calibrations(run.records)
            if not cals:
                continue
            effective += [c for c in cals if c.took_effect]
            last = max(run.records, key=lambda r: r["step"])
            rows.append(f"| {seed} | {arm} | {len(cals)} | {_effect_cell(cals)} | "
                        f"{_fallback_cell(cals)} | {number(last.get('clip/lower'))}, "
                        f"{number(last.get('clip/upper'))} |")
    if len(rows) == 2:
        return "No used run calibrates yet."
    return "\n".join(rows) + "\n\n" + _summary(effective)


def _summary(effective: list[Calibration]) -> str:
    ks = [c.clipped for c in effective if c.clipped is not None]
    if not ks:
        return "No calibration of the used runs took effect: their bounds are the initial ones throughout."
    single = sum(1 for k in ks if k == 1)
    return (f"Of the {plural(len(ks), 'calibration')} that took effect, {single} rested on a single "
            f"BF16-clipped A<0 token (L* then the smallest FP8 ratio of the step's A<0 tokens); "
            f"k ranged {min(ks)}-{max(ks)}, median {statistics.median(ks):g}. L* is what a "
            "calibration reads, not the L it sets: L = min(L*, 1 - eps_low) (widen-only), and after "
            "a run's first effective calibration log-smoothed with the L in force (log L <- beta "
            "log L + (1 - beta) log L*), so an L* near 1 pulls L back toward 1 - eps_low, never "
            "above it. A fallback keeps the bounds in force (reason codes: docs/calibration.md, "
            "\"Guards\").")
