"""The first round's numbers behind the corrections of its reading (issue 27, item 5).

The first reading said the calibrated arm "removes the phantom clips", that blockwise FP8
"does not drift at all", that "every step from 40 on was a retry" in the pooled arm and
that entropy "never spikes again". Each holds only in part; the numbers that say how far
are generated here from the committed `<arm>/metrics.jsonl`, split at the end of the first
`WINDOW` steps (the early phase, while entropy collapses).
"""
from __future__ import annotations

from typing import Optional

from megatron_calibclip.experiment.report import (STEP_WINDOW, WINDOW, mean_of, ranges,
                                                  values_by_step, window_means)


def _between(records: list[dict], key: str, lo: int, hi: int) -> Optional[float]:
    return mean_of([p for p in values_by_step(records, key) if lo <= p[0] < hi])


def calibration_steps(records: list[dict]) -> tuple[list[int], list[int]]:
    """(steps that ran a calibration, those of them that did not fall back)."""
    ran = [r["step"] for r in records if r.get("calib/ran")]
    ok = [r["step"] for r in records if r.get("calib/ran") and not r.get("calib/fallback")]
    return ran, ok


def longest_stretch(steps: list[int]) -> Optional[tuple[int, int]]:
    """(first, last) of the longest run of consecutive steps, if any run has 2 or more."""
    best, start = None, None
    for i, s in enumerate(steps):
        start = s if start is None or s != steps[i - 1] + 1 else start
        if s > start and (best is None or s - start > best[1] - best[0]):
            best = (start, s)
    return best


def _window_range(records: list[dict], key: str, lo: int, hi: int) -> str:
    means = [v for start, v in window_means(records, key).items()
             if v is not None and lo <= start and start + STEP_WINDOW <= hi]
    return f"{min(means):.3f}-{max(means):.3f}" if means else "n/a"


def _fmt(v: Optional[float], digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def facts_table(arms: dict[str, list[dict]]) -> str:
    """Markdown: per arm, the numbers the corrected statements rest on."""
    end = max((r["step"] for recs in arms.values() for r in recs), default=0) + 1
    early, late = f"steps 0-{WINDOW - 1}", f"steps {WINDOW}-{end - 1}"
    rows = [f"| arm | steps | phantom A<0, {early} | phantom A<0, {late} | EOS fraction, {late} "
            f"(lowest-highest {STEP_WINDOW}-step mean) | response length, {late} "
            f"| peak entropy, steps {WINDOW}+ (step) | calibration steps (without fallback) "
            f"| longest stretch of consecutive calibration steps |", "|" + "---|" * 9]
    for arm, recs in arms.items():
        ent = [p for p in values_by_step(recs, "loss/entropy_mean") if p[0] >= WINDOW]
        peak = max(ent, key=lambda p: p[1]) if ent else None
        ran, ok = calibration_steps(recs)
        stretch = longest_stretch(ran)
        run = "none"
        if stretch:
            n_ok = len([s for s in ok if stretch[0] <= s <= stretch[1]])
            run = (f"{stretch[0]}-{stretch[1]}: {stretch[1] - stretch[0] + 1} steps, "
                   f"{n_ok} without fallback")
        rows.append(
            f"| {arm} | {len(recs)} | {_fmt(_between(recs, 'loss/phantom_clipfrac', 0, WINDOW))} "
            f"| {_fmt(_between(recs, 'loss/phantom_clipfrac', WINDOW, end))} "
            f"| {_window_range(recs, 'eos_fraction', WINDOW, end)} "
            f"| {_fmt(_between(recs, 'response_length_mean', WINDOW, end), 1)} "
            f"| {f'{peak[1]:.3f} ({peak[0]})' if peak else 'n/a'} "
            f"| {f'{len(ran)} ({len(ok)})' if ran else 'none'} "
            f"| {run} |")
    return "\n".join(rows) + "\n\n" + facts_summary(arms, end)


def facts_summary(arms: dict[str, list[dict]], end: int) -> str:
    """One generated sentence: the arms and steps, and the phantom rates of the FP8 arms."""
    steps = sorted({len(recs) for recs in arms.values()})
    text = (f"First round: {len(arms)} arms ({', '.join(arms)}), "
            f"{' or '.join(map(str, steps))} steps each, one seed. Rates over A<0 tokens average "
            f"only the steps that had some.")
    key = "loss/phantom_clipfrac"
    fp8 = {a: (_between(r, key, 0, WINDOW), _between(r, key, WINDOW, end))
           for a, r in arms.items() if a.startswith("fp8")}
    early = [e for e, _ in fp8.values() if e is not None]
    late = [v for _, v in fp8.values() if v is not None]
    if early and late:
        text += (f" Phantom clips in the FP8 arms ({', '.join(fp8)}): {min(early):.1%}-{max(early):.1%} "
                 f"of A<0 tokens in steps 0-{WINDOW - 1}, {min(late):.1%}-{max(late):.1%} in steps "
                 f"{WINDOW}-{end - 1}.")
    ran_any = {a: calibration_steps(r) for a, r in arms.items()}
    for arm, (ran, ok) in ran_any.items():
        if ran:
            text += (f" {arm}: {len(ran)} calibration steps ({ranges(ran)}), {len(ok)} without "
                     f"fallback ({ranges(ok)}).")
    return text
