"""The issue's three questions, answered in generated sentences from the paired intervals.

A verdict reads only whether the 95% interval of a paired difference excludes 0: "behind",
"ahead", or "cannot tell" (the interval includes 0, or fewer than 2 paired seeds); the
intervals of the two metrics have the measurement-noise floor (report_paired.pair_intervals),
so two seeds that agree by luck do not make a verdict. "Cannot tell" is never written as
"no difference". Nothing here is typed by hand, so the answer changes when the committed
runs do.
"""
from __future__ import annotations

from typing import Optional

from megatron_calibclip.experiment.report_paired import DIGITS, PAIRS, interval_text, number, pair_intervals
from megatron_calibclip.experiment.report_seeds import SeedRuns, quantity_labels
from megatron_calibclip.experiment.report_stats import Interval

METRICS = ("reward_last", "heldout")  # the quantities the questions are answered on


def sign(iv: Optional[Interval]) -> int:
    """+1 / -1 when the interval lies above / below 0, else 0 (includes 0, or no interval)."""
    if iv is None or not iv.excludes_zero():
        return 0
    return 1 if iv.low > 0 else -1


def evidence(iv: Optional[Interval], name: str) -> str:
    """'<name> +0.100 [+0.050, +0.150] over 3 seeds: interval excludes 0' and the like."""
    if iv is None:
        return f"{name}: no paired seed"
    if iv.low is None:
        return f"{name} {interval_text(iv)}: cannot tell"
    verdict = "interval excludes 0" if iv.excludes_zero() else "interval includes 0"
    return f"{name} {interval_text(iv)} over {iv.n} seeds: {verdict}"


def _q1(iv: dict) -> str:
    d = iv[("fp8-tis", "bf16")]
    return {-1: "yes, FP8 + TIS falls behind BF16", 1: "no, FP8 + TIS is ahead of BF16",
            0: "cannot tell"}[sign(d)] + f" ({evidence(d, 'fp8-tis - bf16')})"


_RELATION = {1: "above", 0: "not distinguishable from", -1: "below"}


def _q2(iv: dict) -> str:
    """'Recover' presupposes a gap: only when FP8 + TIS is measurably behind BF16 is the
    calibrated arm's place between them a recovery; otherwise the answer says so first."""
    up, vs_bf16, gap = iv[("fp8-calibrated", "fp8-tis")], iv[("fp8-calibrated", "bf16")], iv[("fp8-tis", "bf16")]
    s_up, s_bf, s_gap = sign(up), sign(vs_bf16), sign(gap)
    if s_gap >= 0:
        where = f"Calibrated Clipping is {_RELATION[s_up]} FP8 + TIS and {_RELATION[s_bf]} BF16"
        if s_gap > 0:
            head = f"no gap to recover: FP8 + TIS is ahead of BF16; {where}"
        else:  # 'cannot tell' is not 'no gap': say how large a deficit the interval leaves open
            open_deficit = (f", a deficit down to {number(gap.low, sign=True)} not excluded"
                            if gap is not None and gap.low is not None and gap.low < 0 else "")
            head = f"no measured gap to recover: FP8 + TIS is not distinguishable from BF16{open_deficit}; {where}"
    elif s_up > 0:
        head = {0: "yes: above FP8 + TIS and not distinguishable from BF16",
                -1: "in part: above FP8 + TIS but still below BF16",
                1: "yes: above FP8 + TIS and above BF16"}[s_bf]
    elif s_up < 0:
        head = "no: below FP8 + TIS"
    else:
        head = "cannot tell whether it improves on FP8 + TIS"
    return (f"{head} ({evidence(up, 'fp8-calibrated - fp8-tis')}; "
            f"{evidence(vs_bf16, 'fp8-calibrated - bf16')})")


# what each comparison of the third question says, by the sign of its interval
_L_SAYS = {1: "L-only is above FP8 + TIS", 0: "L-only is not distinguishable from FP8 + TIS",
           -1: "L-only is below FP8 + TIS"}
_H_SAYS = {1: "the full method is above L-only", 0: "the full method is not distinguishable from L-only",
           -1: "the full method is below L-only"}


def _credit(s_l: int, s_h: int) -> str:
    """What recovers it: the calibrated L when L-only beats FP8 + TIS, the wider H when the
    full method beats L-only; a full method below L-only means the wider H costs."""
    if s_l > 0 and s_h > 0:
        return "both"
    if s_h > 0:
        return "the wider H"
    head = "the calibrated L" if s_l > 0 else "neither"
    return head + (", and the wider H costs" if s_h < 0 else "")


def _q3(iv: dict) -> str:
    l_only = iv[("fp8-calibrated-l-only", "fp8-tis")]
    h_on_top = iv[("fp8-calibrated", "fp8-calibrated-l-only")]
    s_l, s_h = sign(l_only), sign(h_on_top)
    if s_l == 0 and s_h == 0:
        head = "no measured effect to attribute: neither interval excludes 0"
    else:
        head = f"{_credit(s_l, s_h)}: {_L_SAYS[s_l]}, {_H_SAYS[s_h]}"
    return (f"{head} ({evidence(l_only, 'fp8-calibrated-l-only - fp8-tis')}; "
            f"{evidence(h_on_top, 'fp8-calibrated - fp8-calibrated-l-only')})")


QUESTIONS = (("Does full FP8 + TIS fall behind BF16?", _q1),
             ("Does Calibrated Clipping recover it?", _q2),
             ("Is it the calibrated L or the wider H (the L-only arm)?", _q3))


DESIGNED = ("lower_late", "upper_late")  # the bounds: the arms differ in them by construction


def _l_also_differs(seeds: SeedRuns) -> str:
    """The full method and L-only calibrate on their own rollouts, so their L differs too: the
    third question's second comparison is not H alone."""
    _, iv = pair_intervals(seeds, "lower_late")[("fp8-calibrated", "fp8-calibrated-l-only")]
    label = quantity_labels(seeds.target)["lower_late"]
    return (f"The third question's fp8-calibrated - fp8-calibrated-l-only is not H alone: each arm "
            f"calibrates L on its own rollouts, so L differs as well ({label}: "
            f"{interval_text(iv)}).")


def other_findings(seeds: SeedRuns) -> str:
    """The paired differences outside the answers' two metrics whose interval excludes 0 (the
    bounds, different by design, left out): what else the runs measurably differ in."""
    labels = quantity_labels(seeds.target)
    found = []
    for q, label in labels.items():
        if q in METRICS or q in DESIGNED:
            continue
        digits = DIGITS.get(q, 3)
        pairs = [f"{arm} - {base} {interval_text(iv, digits)} "
                 f"({' / '.join(number(d, digits, True) for d in diffs.values())})"
                 for (arm, base), (diffs, iv) in pair_intervals(seeds, q).items()
                 if iv is not None and iv.excludes_zero()]
        if pairs:
            found.append(f"{label}: " + ", ".join(pairs))
    head = ("Other paired differences whose interval excludes 0 (not among the answers' metrics; "
            "plain t-intervals, without a noise floor, so two seeds that agree by luck count; the "
            "bounds, set by design, left out): ")
    return head + ("; ".join(found) if found else "none") + "."


def answers(seeds: SeedRuns) -> str:
    """Markdown bullets: each question, answered on each metric of METRICS; then what the third
    question's comparison also changes, and the other measurable differences."""
    labels = quantity_labels(seeds.target)
    intervals = {q: {pair: iv for pair, (_, iv) in pair_intervals(seeds, q).items()} for q in METRICS}
    lines = []
    for question, answer in QUESTIONS:
        parts = [f"on {labels[q]}: {answer(intervals[q])}" for q in METRICS]
        lines.append(f"- **{question}** " + "; ".join(parts) + ".")
    if ("fp8-calibrated", "fp8-calibrated-l-only") in PAIRS:
        lines.append("\n" + _l_also_differs(seeds))
    lines.append("\n" + other_findings(seeds))
    return "\n".join(lines)
