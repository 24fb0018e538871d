"""The second round's tables: which runs were used, each arm per seed, the paired differences
with their 95% t-intervals, and the within-run noise.

Every number in them is computed here from the committed seed folders (report_seeds), so the
document's reading can refer to them instead of retyping them.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Optional

from megatron_calibclip.experiment.report import WINDOW, ranges
from megatron_calibclip.experiment.report_seeds import (
    HELDOUT_FROM, NOISE_FLOORED, SeedRuns, heldout_noise, heldout_problems, paired, paired_floor,
    quantity_labels, reward_noise)
from megatron_calibclip.experiment.report_stats import LEVEL, Interval, t_interval, t_quantile

# (arm, baseline): each difference is arm - baseline within one seed
PAIRS = (("fp8-tis", "bf16"), ("fp8-calibrated", "fp8-tis"), ("fp8-calibrated", "bf16"),
         ("fp8-calibrated-l-only", "fp8-tis"), ("fp8-calibrated", "fp8-calibrated-l-only"))
DIGITS = {"mismatch": 4, "mismatch_max": 4, "kl_last": 4}  # every other quantity: 3


def pair_label(arm: str, base: str) -> str:
    return f"{arm} - {base}"


def coverage(seeds: SeedRuns) -> str:
    """Markdown: every seed x arm, its steps, whether it is used (or why not), commit, samples."""
    rows = ["| seed | arm | steps | used | commit | samples | minutes of steps |",
            "|---|---|---|---|---|---|---|"]
    for seed in seeds.seeds():
        for arm in seeds.arms():
            run, why = seeds.runs.get((seed, arm)), seeds.why_not(seed, arm)
            steps = ranges(run.steps) if run and run.steps else "none"
            minutes = f"{run.minutes:.0f}" if run and run.minutes is not None else "n/a"
            rows.append(f"| {seed} | {arm} | {steps} | {'yes' if why is None else 'no: ' + why} "
                        f"| {run.commit if run else 'n/a'} | {run.samples if run else 0} | {minutes} |")
    used = [f"{a} (seeds {ranges(sorted(seeds.usable(a)))})" for a in seeds.arms() if seeds.usable(a)]
    left = [f"seed-{s}/{a} ({seeds.why_not(s, a)})" for s in seeds.seeds() for a in seeds.arms()
            if seeds.why_not(s, a) is not None]
    text = (f"Used: {'; '.join(used) or 'no run'}; steps 0-{seeds.target - 1} of every used run. "
            f"Left out: {'; '.join(left) or 'nothing'}. {code_line(seeds)}")
    return "\n".join(rows) + "\n\n" + text.rstrip()


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def code_line(seeds: SeedRuns) -> str:
    """Which code the used runs ran (run_info.json): a run is used whatever its commit, so a
    seed run from another clone, or with uncommitted changes, is named here."""
    used = sorted((s, a) for a in seeds.arms() for s in seeds.usable(a))
    if not used:
        return ""
    commits, several, unknown, dirty = Counter(), [], [], []
    for seed, arm in used:
        info, name = seeds.runs[(seed, arm)].info, f"seed-{seed}/{arm}"
        if info.get("commit"):
            commits[str(info["commit"])[:10]] += 1
        else:
            (several if info.get("commits") else unknown).append(name)
        if info.get("dirty"):
            dirty.append(name)
    if len(commits) == 1 and not (several or unknown or dirty):
        return f"Code: every used run ran commit {next(iter(commits))}, none with uncommitted changes."
    parts = [f"the used runs ran {plural(len(commits), 'commit')}: "
             + ", ".join(f"{c} ({plural(n, 'run')})" for c, n in sorted(commits.items()))] if commits else []
    for label, names in (("several commits", several), ("commit unknown", unknown),
                         ("with uncommitted changes", dirty)):
        if names:
            parts.append(f"{label}: {', '.join(names)}")
    return "Code: " + "; ".join(parts) + "."


def number(v: object, digits: int = 3, sign: bool = False) -> str:
    """A table cell's number; "n/a" for anything that is not one (None, a bool, text)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "n/a"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def arm_table(seeds: SeedRuns) -> str:
    """Markdown: per quantity and arm, the mean over seeds and (each seed's value)."""
    arms = [a for a in seeds.arms() if seeds.usable(a)]
    labels = quantity_labels(seeds.target)
    values = {a: {s: seeds.quantities(s, a) for s in seeds.usable(a)} for a in arms}
    rows = ["| quantity | " + " | ".join(arms) + " |", "|" + "---|" * (len(arms) + 1)]
    for q, label in labels.items():
        cells = []
        for a in arms:
            per_seed = [values[a][s][q] for s in sorted(values[a])]
            known = [v for v in per_seed if v is not None]
            mean = statistics.fmean(known) if known else None
            digits = DIGITS.get(q, 3)
            cells.append(f"{number(mean, digits)} ({' / '.join(number(v, digits) for v in per_seed)})")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + ("\n\nMean over the used seeds (each seed's value in seed order). Rates "
                              "over A<0 (A>0) tokens average only the steps that had some.")


def interval_text(iv: Optional[Interval], digits: int = 3) -> str:
    if iv is None:
        return "n/a"
    if iv.low is None:
        return f"{number(iv.mean, digits, True)} (1 seed: no interval)"
    return (f"{number(iv.mean, digits, True)} [{number(iv.low, digits, True)}, "
            f"{number(iv.high, digits, True)}]" + (" (floor)" if iv.floored else ""))


def pair_intervals(seeds: SeedRuns, quantity: str) -> dict[tuple[str, str], tuple[dict, Optional[Interval]]]:
    """{(arm, base): ({seed: difference}, interval)} for every pair of PAIRS; the quantities
    whose within-run noise is known (NOISE_FLOORED) take it as the floor of s."""
    out = {}
    for arm, base in PAIRS:
        diffs = paired(seeds, quantity, arm, base)
        floor = paired_floor(seeds, quantity, arm, base) if quantity in NOISE_FLOORED else 0.0
        out[(arm, base)] = (diffs, t_interval(list(diffs.values()), floor=floor))
    return out


def paired_table(seeds: SeedRuns) -> str:
    """Markdown: per quantity and pair, mean difference [95% interval] (each seed's difference)."""
    rows = ["| quantity | " + " | ".join(pair_label(a, b) for a, b in PAIRS) + " |",
            "|" + "---|" * (len(PAIRS) + 1)]
    for q, label in quantity_labels(seeds.target).items():
        digits = DIGITS.get(q, 3)
        cells = [interval_text(iv, digits) + (
                     f" ({' / '.join(number(d, digits, True) for d in diffs.values())})" if diffs
                     else " (no paired seed yet)")
                 for diffs, iv in pair_intervals(seeds, q).values()]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + (f"\n\nMean of the per-seed differences [{LEVEL:.0%} t-interval] (each "
                              "seed's difference in seed order); only seeds where both arms are used. "
                              "(floor): s raised to the measurement-noise floor (below). An interval "
                              "reaching past what a quantity can be (a fraction's difference beyond "
                              "+-1) says only that the seeds disagree.")


def method_text(seeds: SeedRuns) -> str:
    """How the intervals are computed, with the t quantiles of the seed counts present."""
    ns = sorted({len(d) for q in ("reward_last", "heldout")
                 for d, _ in pair_intervals(seeds, q).values() if len(d) >= 2})
    quant = "; ".join(f"n = {n}: t = {t_quantile((1 + LEVEL) / 2, n - 1):.2f}, half-width "
                      f"{t_quantile((1 + LEVEL) / 2, n - 1) / math.sqrt(n):.2f} s" for n in ns)
    return (f"How the intervals are computed: each quantity is computed per run; for a pair of arms "
            f"the difference is taken within each seed (the arms of a seed share the data order), "
            f"and the {LEVEL:.0%} interval is mean +- t(n - 1) * s / sqrt(n), s the standard "
            f"deviation of the n per-seed differences (n - 1 in its denominator), t Student's "
            f"{(1 + LEVEL) / 2:.3f} quantile. {quant or 'Fewer than 2 paired seeds: no interval'}. "
            f"With few seeds the interval is wide: only a difference that is large and consistent "
            f"across seeds excludes 0, and an interval that includes 0 means 'cannot tell', not "
            f"'equal'. Noise floor (training reward and held-out accuracy, [ours]): a per-seed "
            f"difference carries its two runs' within-run noise (the standard errors of the Noise "
            f"table), so s is taken as at "
            f"least sqrt(mean over seeds of noise(arm)^2 + noise(base)^2); otherwise two "
            f"differences that agree by luck would give a narrow interval (marked '(floor)' where "
            f"the floor is larger than s). Held-out accuracy of a run: the mean of its evaluations "
            f"after {HELDOUT_FROM} or more updates (updates: RL steps applied; each makes one "
            f"optimizer step per mini-batch).")


def noise_text(seeds: SeedRuns) -> str:
    """Markdown: within-run and between-seed noise of the last-20 reward and the held-out mean,
    and the binomial error of one held-out evaluation."""
    rows = [f"| arm | used seeds | within-run SE of the last-{WINDOW} reward (mean over seeds) "
            f"| between-seed sd of the last-{WINDOW} reward | within-run SE of the held-out mean "
            f"(mean over seeds) | between-seed sd of the held-out mean | held-out binomial SE of "
            f"one evaluation |", "|---|---|---|---|---|---|---|"]
    within_all = []
    for arm in seeds.arms():
        runs = seeds.usable(arm)
        if not runs:
            continue
        within = [w for r in runs.values() if (w := reward_noise(r.records, seeds.target)) is not None]
        within_all += within
        held_within = [w for r in runs.values() if (w := heldout_noise(r.records)) is not None]
        last = [v for s in runs if (v := seeds.quantities(s, arm)["reward_last"]) is not None]
        held = [(v, n) for s, r in runs.items() if (v := seeds.quantities(s, arm)["heldout"]) is not None
                and (n := heldout_problems(r.records))]
        p = statistics.fmean(v for v, _ in held) if held else None
        binom = math.sqrt(p * (1 - p) / statistics.fmean(n for _, n in held)) if held else None
        cells = (statistics.fmean(within) if within else None,
                 statistics.stdev(last) if len(last) >= 2 else None,
                 statistics.fmean(held_within) if held_within else None,
                 statistics.stdev([v for v, _ in held]) if len(held) >= 2 else None, binom)
        rows.append(f"| {arm} | {len(runs)} | " + " | ".join(number(c) for c in cells) + " |")
    summary = (f"Within one run, a last-{WINDOW} reward mean carries about +-"
               f"{number(statistics.fmean(within_all) if within_all else None)} (std of its per-step "
               f"rewards / sqrt({WINDOW}), mean over the used runs) if the steps were independent; "
               f"the held-out mean likewise (std of its evaluations after {HELDOUT_FROM}+ updates / "
               f"sqrt(their number)). The binomial SE is sqrt(p (1 - p) / problems) at the arm's "
               f"mean held-out accuracy p: how far one evaluation's problems could move it. Every "
               f"evaluation of every arm decodes the same problems greedily, so that part is shared "
               f"by the arms and not in the paired differences' noise floor.")
    return "\n".join(rows) + "\n\n" + summary
