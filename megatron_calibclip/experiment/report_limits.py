"""What the seeded rounds can and cannot show, as generated numbers.

Why a section of its own: a reading that says "Calibrated Clipping removes the phantom clips"
or "no difference" must rest on figures a reader can recompute: how many of an arm's clipped
A<0 tokens are phantom ones (clipped by FP8 where BF16, read at the host's 1 - eps_low, would
not clip), how often the first calibration fell back, and how many paired seeds a reward
difference of a given size would need, with how uncertain that count is at three seeds.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from megatron_calibclip.experiment.report_paired import number
from megatron_calibclip.experiment.report_seeds import SeedRuns, paired
from megatron_calibclip.experiment.report_stats import t_quantile

EARLY = 20  # steps 0-19, then 20 to the end (the windows of the other tables)
POWER, ALPHA = 0.8, 0.05  # a two-sided paired t-test with 80% power at 5%
DELTAS = (0.05, 0.10)  # reward / accuracy differences a reader would care about
PAIRS = (("fp8-calibrated", "fp8-tis"), ("fp8-wide-fixed", "fp8-tis"),
         ("fp8-calibrated", "fp8-wide-fixed"), ("bf16", "fp8-tis"))


def phantom_share(records: list[dict], lo: int, hi: Optional[int]) -> Optional[float]:
    """Phantom A<0 clips over all A<0 clips in steps [lo, hi): the ratio of the two per-step
    fractions' sums (loss/phantom_clipfrac over loss/clipfrac_lower, both per A<0 token, so
    steps with more A<0 tokens are not weighted up: the metrics keep no per-step count)."""
    rows = [r for r in records if lo <= r["step"] < (hi if hi is not None else 10**9)
            and r.get("loss/clipfrac_lower") is not None and r.get("loss/phantom_clipfrac") is not None]
    clipped = math.fsum(r["loss/clipfrac_lower"] for r in rows)
    return math.fsum(r["loss/phantom_clipfrac"] for r in rows) / clipped if clipped > 0 else None


def phantom_share_table(seeds: SeedRuns) -> str:
    lines = [f"| arm | phantom share of its A<0 clips, steps 0-{EARLY - 1} | steps "
             f"{EARLY}-{seeds.target - 1} | per seed (early / late) |", "|---|---|---|---|"]
    for arm in seeds.arms():
        runs = seeds.usable(arm)
        if not runs or arm == "bf16":
            continue
        early = [phantom_share(r.records, 0, EARLY) for r in runs.values()]
        late = [phantom_share(r.records, EARLY, None) for r in runs.values()]
        per_seed = ", ".join(f"{s}: {number(e, 2)} / {number(l, 2)}"
                             for s, e, l in zip(runs, early, late))
        lines.append(f"| {arm} | {_mean(early)} | {_mean(late)} | {per_seed} |")
    return "\n".join(lines)


def _mean(values: list[Optional[float]]) -> str:
    known = [v for v in values if v is not None]
    return number(statistics.fmean(known), 3) if known else "-"


def first_calibrations(seeds: SeedRuns, arms=("fp8-calibrated", "fp8-calibrated-l-only")) -> str:
    """How many calibrated runs' step-0 calibration fell back, and the first step whose
    calibration succeeded (the bounds before it are the initial ones)."""
    fell, firsts = 0, []
    for arm in arms:
        for run in seeds.usable(arm).values():
            calibrated = [r for r in run.records if r.get("calib/ran")]
            if calibrated and calibrated[0]["step"] == 0 and calibrated[0].get("calib/fallback"):
                fell += 1
            ok = [r["step"] for r in calibrated if r.get("calib/fallback") == 0.0]
            firsts.append(str(ok[0]) if ok else "none")
    total = len(firsts)
    return (f"The step-0 calibration fell back in {fell} of {total} calibrated runs (arms "
            f"{', '.join(arms)}); the first successful calibration came at step "
            f"{', '.join(firsts)} (in run order), so until then those runs clipped at the initial "
            f"bounds.")


def seeds_needed(sd: float, delta: float, power: float = POWER, alpha: float = ALPHA) -> int:
    """Smallest n for a two-sided paired t-test to detect a mean difference `delta` with
    `power`, when paired differences have standard deviation `sd`: n >= ((t_{1-a/2,n-1} +
    t_{power,n-1}) sd / delta)^2, iterated from the normal approximation."""
    if sd <= 0:
        return 2
    n = 2
    while True:
        df = n - 1
        need = ((t_quantile(1 - alpha / 2, df) + t_quantile(power, df)) * sd / delta) ** 2
        if n >= need:
            return n
        n += 1
        if n > 100_000:
            return n


def chi2_cdf(x: float, df: int) -> float:
    """P(X <= x) for chi-square with integer `df`: the closed forms of the regularised gamma
    function at half-integer and integer shape (no scipy in the package)."""
    if x <= 0:
        return 0.0
    h = x / 2.0
    if df % 2 == 0:
        term, acc = 1.0, 0.0
        for k in range(df // 2):
            acc += term
            term *= h / (k + 1)
        return 1.0 - math.exp(-h) * acc
    acc, term = 0.0, math.sqrt(h) / math.gamma(1.5)
    for k in range((df - 1) // 2):
        acc += term
        term *= h / (k + 1.5)
    return math.erf(math.sqrt(h)) - math.exp(-h) * acc


def chi2_quantile(p: float, df: int) -> float:
    """The `p`-quantile of chi-square with `df` degrees of freedom (bisection on chi2_cdf)."""
    lo, hi = 0.0, max(1.0, 10.0 * df)
    while chi2_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def power_table(seeds: SeedRuns) -> str:
    """Seeds needed per pair and quantity, from the spread of the paired differences, with the
    range the 95% interval of that spread gives at n - 1 degrees of freedom."""
    lines = ["| difference | quantity | seeds | SD of paired differences [95%] | seeds needed "
             "for 0.05 [range] | for 0.10 [range] |", "|---|---|---|---|---|---|"]
    for arm, base in PAIRS:
        for quantity, label in (("reward_last", "training reward, last 20"),
                                ("heldout", "held-out accuracy")):
            diffs = list(paired(seeds, quantity, arm, base).values())
            if len(diffs) < 2:
                continue
            df = len(diffs) - 1
            sd = statistics.stdev(diffs)
            lo = sd * math.sqrt(df / chi2_quantile(0.975, df))
            hi = sd * math.sqrt(df / chi2_quantile(0.025, df))
            cells = [f"{seeds_needed(sd, d)} [{seeds_needed(lo, d)}-{seeds_needed(hi, d)}]"
                     for d in DELTAS]
            lines.append(f"| {arm} - {base} | {label} | {len(diffs)} | {number(sd, 3)} "
                         f"[{number(lo, 3)}, {number(hi, 3)}] | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def fisher_two_sided(a: int, n1: int, b: int, n2: int) -> float:
    """Fisher's exact test, two-sided, of a/n1 against b/n2 (hypergeometric, the sum of the
    tables no likelier than the one seen)."""
    total, k = n1 + n2, a + b

    def prob(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, k - x) / math.comb(total, k)

    seen = prob(a)
    tables = range(max(0, k - n2), min(k, n1) + 1)
    return min(1.0, math.fsum(prob(x) for x in tables if prob(x) <= seen * (1 + 1e-9)))


def eos_outcome(seeds: SeedRuns, arm: str = "fp8-tis", base: str = "fp8-calibrated") -> str:
    """The answers-end finding as what it is: a per-run yes/no (EOS fraction over the last 20
    steps above one half), compared by Fisher's exact test."""
    def ended(name: str) -> tuple[int, int]:
        values = [seeds.quantities(s, name)["eos_last"] for s in seeds.usable(name)]
        known = [v for v in values if v is not None]
        return sum(v > 0.5 for v in known), len(known)

    (a, n1), (b, n2) = ended(arm), ended(base)
    if not n1 or not n2:
        return "No EOS comparison yet."
    used = [name for name in seeds.arms() if seeds.usable(name)]
    counts = ", ".join(f"{name} {ended(name)[0]} of {ended(name)[1]}" for name in used)
    return (f"Runs whose answers end (EOS fraction over the last 20 steps above one half): "
            f"{counts}. {arm} against {base}: Fisher's exact test, two-sided, p = "
            f"{fisher_two_sided(a, n1, b, n2):.3f}, one of {math.comb(len(used), 2)} arm pairs "
            f"one could have picked; a per-run outcome, not a measured rate.")


def limits_section(seeds: Optional[SeedRuns]) -> str:
    if seeds is None or not any(seeds.usable(a) for a in seeds.arms()):
        return "No complete seeded run yet."
    return "\n\n".join([
        "**Phantom share of the clips** (clipped by FP8 at the bound in force, not by BF16 at "
        "1 - eps_low; per arm, the mean over its seeds)", phantom_share_table(seeds),
        "**First calibrations**", first_calibrations(seeds),
        "**How the answers end**", eos_outcome(seeds),
        f"**Seeds a paired comparison would need** ({int(POWER * 100)}% power, two-sided "
        f"{ALPHA:g}; the range: the same count at the ends of the spread's 95% interval, "
        f"chi-square at n - 1 degrees of freedom)", power_table(seeds)])
