"""The second round's figure, built around the paired comparison.

Per arm: the mean over seeds (bold) and the seeds themselves: with few seeds (SEED_LINES) each
seed's curve (thin), since a mean and min-max band of two seeds that disagree draw a line no run
had and a band over the whole panel; with more, the band (min to max); error bars: min to max.
The training reward with its last-20 window shaded and a marker per arm for the
last-20 mean; held-out accuracy with error bars; the paired differences with their 95%
t-intervals; and the quantities the reading rests on (entropy, KL, EOS fraction, rollout/
trainer mismatch, phantom clips, clip bounds). The bounds are drawn per step as in force, on
a logarithmic axis whose range holds all of them; coincident bound lines are told apart by staggered markers
and labelled once per value at the right edge, so none hides another.
"""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.ticker import FixedLocator, FormatStrFormatter, MaxNLocator, NullFormatter

from megatron_calibclip.experiment.report import (SMOOTH, STEP_WINDOW, WINDOW, heldout, rolling_mean,
                                                  values_by_step, window_means)
from megatron_calibclip.experiment.report_answers import METRICS
from megatron_calibclip.experiment.report_paired import pair_intervals, pair_label, plural
from megatron_calibclip.experiment.report_seeds import HELDOUT_FROM, SeedRuns, quantity_labels

ARM_COLORS = {"bf16": "tab:blue", "fp8-tis": "tab:purple", "fp8-calibrated": "tab:green",
              "fp8-calibrated-l-only": "tab:orange"}
OTHER_COLORS = ("tab:red", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
CURVES = (  # (panel title, key, y label): per-step panels drawn as mean + seeds (or band)
    ("training reward (sampled)", "reward_mean", "mean reward"),
    ("entropy (mean over response tokens)", "loss/entropy_mean", "nats"),
    ("KL to the reference", "loss/kl_mean", "k3 KL"),
    ("EOS fraction (answers that end)", "eos_fraction", "fraction of responses"),
    ("rollout/trainer mismatch", "loss/mult_prob_error", "mean exp|log p_rollout - log p_trainer|"),
)


def arm_colors(arms: list[str]) -> dict[str, str]:
    others = iter(OTHER_COLORS * (1 + len(arms)))
    return {a: ARM_COLORS.get(a) or next(others) for a in arms}


SEED_LINES = 3  # an arm with at most this many used seeds draws each seed, not a band


def _seed_curves(runs: dict, key: str, target: int, smooth: int = SMOOTH) -> list[dict[int, float]]:
    """Each seed's `smooth`-step rolling mean of `key`, {step: value}, in the runs' order."""
    per_seed = []
    for run in runs.values():
        pts = dict(values_by_step(run.records, key))
        steps = [s for s in range(target) if s in pts]
        per_seed.append(dict(zip(steps, rolling_mean([pts[s] for s in steps], smooth))))
    return per_seed


def _band(runs: dict, key: str, target: int, smooth: int = SMOOTH, geometric: bool = False
          ) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) across seeds of each seed's `smooth`-step rolling mean of `key`
    (`geometric`: the mean of the seeds is geometric, for ratios such as the clip bounds)."""
    per_seed = _seed_curves(runs, key, target, smooth)
    xs = [s for s in range(target) if all(s in d for d in per_seed)]
    cols = [[d[s] for d in per_seed] for s in xs]
    if geometric:
        mean = [math.exp(math.fsum(math.log(v) for v in c) / len(c)) for c in cols]
    else:
        mean = [math.fsum(c) / len(c) for c in cols]
    return xs, mean, [min(c) for c in cols], [max(c) for c in cols]


def _curve_panel(ax, seeds: SeedRuns, arms: list[str], colors: dict, key: str) -> None:
    """Per arm the mean over seeds (bold) over each seed's curve (thin) when the arm has at
    most SEED_LINES seeds (seeds 0.0 and 0.99 apart would draw a mean of 0.5 no run had, in a
    band over the whole panel), else over the min-max band."""
    for arm in arms:
        runs = seeds.usable(arm)
        xs, mean, lo, hi = _band(runs, key, seeds.target)
        if not xs:
            continue
        if len(runs) <= SEED_LINES:
            for curve in _seed_curves(runs, key, seeds.target):
                steps = sorted(curve)
                ax.plot(steps, [curve[s] for s in steps], color=colors[arm], lw=0.9, alpha=0.5)
        else:
            ax.fill_between(xs, lo, hi, color=colors[arm], alpha=0.15, lw=0)
        ax.plot(xs, mean, color=colors[arm], lw=1.8)


def _spread_text(seed_counts: list[int]) -> str:
    """What the figure draws around the means, for the arms' numbers of used seeds."""
    few = [n <= SEED_LINES for n in seed_counts]
    if all(few):
        return "thin: each seed; bars = min-max across seeds"
    if not any(few):
        return "band / bars = min-max across seeds"
    return (f"thin: each seed (arms of <= {SEED_LINES} seeds), band (more seeds) / bars = min-max "
            "across seeds")


def _bars(mean: float, values: list[float]) -> list[list[float]]:
    """[[below], [above]]: the min-max range around a mean as non-negative bar lengths (the
    mean of equal values can exceed their max by a rounding step; matplotlib >= 3.11 refuses
    a negative length)."""
    return [[max(0.0, mean - min(values))], [max(0.0, max(values) - mean)]]


def _last_markers(ax, seeds: SeedRuns, arms: list[str], colors: dict) -> None:
    """Shade the last-WINDOW steps; per arm, the mean of the seeds' last-window means and their range."""
    ax.axvspan(seeds.target - WINDOW, seeds.target - 1, color="0.9", zorder=0)
    for i, arm in enumerate(arms):
        means = [math.fsum(v for _, v in pts) / len(pts) for run in seeds.usable(arm).values()
                 if (pts := [p for p in values_by_step(run.records, "reward_mean")
                             if p[0] >= seeds.target - WINDOW])]
        if means:
            m = math.fsum(means) / len(means)
            ax.errorbar([seeds.target + 2 + 2 * i], [m], yerr=_bars(m, means),
                        fmt="D", color=colors[arm], ms=6, capsize=3)
    ax.text(seeds.target - WINDOW / 2, ax.get_ylim()[0], f"last {WINDOW}", ha="center", va="bottom",
            fontsize=8, color="0.4")


def _offset_errorbars(ax, arms: list[str], colors: dict, points: dict, spread: float) -> None:
    """points[arm] = {x: [values over seeds]}: mean with min-max bars, arms side by side."""
    for i, arm in enumerate(arms):
        xs = sorted(points.get(arm, {}))
        if not xs:
            continue
        shift = (i - (len(arms) - 1) / 2) * spread
        vals = [points[arm][x] for x in xs]
        means = [math.fsum(v) / len(v) for v in vals]
        bars = [_bars(m, v) for m, v in zip(means, vals)]
        yerr = [[b[0][0] for b in bars], [b[1][0] for b in bars]]
        ax.errorbar([x + shift for x in xs], means, yerr=yerr, fmt="o-", color=colors[arm], ms=4,
                    lw=1.2, capsize=2)


def _heldout_panel(ax, seeds: SeedRuns, arms: list[str], colors: dict) -> None:
    points = {}
    for arm in arms:
        for run in seeds.usable(arm).values():
            for updates, acc in heldout(run.records):
                points.setdefault(arm, {}).setdefault(updates, []).append(acc)
    _offset_errorbars(ax, arms, colors, points, spread=1.0)
    ax.axvline(HELDOUT_FROM, color="0.6", ls=":", lw=1)


def _phantom_panel(ax, seeds: SeedRuns, arms: list[str], colors: dict) -> None:
    points = {}
    for arm in arms:
        for run in seeds.usable(arm).values():
            for start, v in window_means(run.records, "loss/phantom_clipfrac").items():
                if v is not None:
                    points.setdefault(arm, {}).setdefault(start + STEP_WINDOW / 2, []).append(v)
    _offset_errorbars(ax, arms, colors, points, spread=1.2)


ROW_POINTS = 9  # font size of the forest panel's row labels
FOREST_ROOM = 0.035  # figure width the forest panel gives up on its left, for its row labels


def _forest_row(ax, y: float, diffs: dict, iv, color: str) -> bool:
    """One pair's row, drawn bottom up: the mean (diamond), the interval over it with caps (so
    a short one still shows; black and thick when it excludes 0), the seeds' dots on top with
    a white edge. Returns whether the interval excludes 0."""
    excludes = iv is not None and iv.excludes_zero()
    if iv is not None:
        ax.plot([iv.mean], [y], "D", color=color, ms=7, zorder=2)
        if iv.low is not None:
            ax.plot([iv.low, iv.high], [y, y], color="k" if excludes else color, lw=3.5 if excludes else 1.8,
                    marker="|", ms=12, mew=2.5 if excludes else 1.5, solid_capstyle="butt", zorder=3)
    ax.plot(list(diffs.values()), [y] * len(diffs), "o", ls="none", mfc="0.15", mec="white", mew=0.9,
            ms=5, zorder=4)
    return excludes


def _forest_panel(ax, seeds: SeedRuns, colors: dict) -> None:
    """Paired differences: each seed a dot, the mean a diamond, the 95% t-interval a bar; one
    group of rows per metric, headed by its name; a row whose interval excludes 0 ends in '*'."""
    labels, y = quantity_labels(seeds.target), 0.0
    ticks, marked = [], False
    for q in METRICS:
        ax.text(0.01, y - 0.35, labels[q], transform=ax.get_yaxis_transform(), fontsize=ROW_POINTS,
                style="italic", va="center", bbox={"fc": "white", "ec": "none", "pad": 1}, zorder=5)
        y -= 0.5
        for (arm, base), (diffs, iv) in pair_intervals(seeds, q).items():
            y -= 1
            excludes = _forest_row(ax, y, diffs, iv, colors.get(arm, "k"))
            ticks.append((y, pair_label(arm, base) + (" *" if excludes else "")))
            marked |= excludes
        y -= 0.6
    ax.axvline(0, color="k", lw=0.8, zorder=1)
    ax.set_ylim(y + 0.3, 0.2)
    ax.set_yticks([t for t, _ in ticks], [text for _, text in ticks], fontsize=ROW_POINTS)
    ax.set_xlabel("difference (arm - baseline)")
    ax.set_title("paired differences: dots = seeds, diamond = mean,\nbar = 95% t-interval"
                 + ("; * interval excludes 0" if marked else ""), fontsize=11)


MARKERS = ("o", "s", "^", "v", "P", "X")
BOUND_TICKS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)


def _bounds_panel(ax, seeds: SeedRuns, arms: list[str], colors: dict) -> None:
    """L (solid) and H (dashed) per arm, per step as in force (a step function: not smoothed),
    geometric mean over seeds with their min-max band, on a logarithmic axis: bounds are
    ratios, and a calibrated pair can span 0.1 to 6.5 beside the fixed 0.8 and 1.2. Arms with
    equal bounds share a line, so each arm's markers sit at its own steps (staggered) and the
    right edge names every arm per value (at the last step: not the tables' means over steps).
    The y range holds every step's bound, not only the final ones."""
    ax.set_title("clip bounds in force (L solid, H dashed); band: min-max\nbold = geometric mean over "
                 "seeds; right edge: at the last step", fontsize=10)
    finals, drawn = {}, []
    every = max(seeds.target // 10, len(arms))
    for i, arm in enumerate(arms):
        for key, style in (("clip/lower", "-"), ("clip/upper", "--")):
            xs, mean, lo, hi = _band(seeds.usable(arm), key, seeds.target, smooth=1,
                                     geometric=True)
            if xs:
                ax.fill_between(xs, lo, hi, color=colors[arm], alpha=0.12, lw=0, step="post")
                ax.plot(xs, mean, style, color=colors[arm], lw=1.3, marker=MARKERS[i % len(MARKERS)],
                        ms=5, markevery=(i * every // len(arms), every), drawstyle="steps-post")
                drawn += lo + hi
                finals.setdefault(round(mean[-1], 2), []).append(f"{arm} {'L' if 'lower' in key else 'H'}")
    if not finals:
        return
    values = sorted(finals)
    bottom, top = math.log(min(drawn + values)), math.log(max(drawn + values))
    span = max(top - bottom, math.log(2.0))  # in log r
    low, high = bottom - 0.1 * span, top + 0.1 * span
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(0, seeds.target * 1.6)  # room for the labels, but ticks only at steps run
    ax.xaxis.set_major_locator(FixedLocator(_step_ticks(seeds.target)))
    high = _label_bounds(ax, finals, seeds.target, low, high)
    ax.set_ylim(math.exp(low), math.exp(high))
    ax.yaxis.set_major_locator(FixedLocator([t for t in BOUND_TICKS if low <= math.log(t) <= high]))


def _step_ticks(target: int) -> list[float]:
    """Round ticks from step 0 to the last step (target - 1), none in the labels' room after it."""
    return [t for t in MaxNLocator(nbins=6, integer=True).tick_values(0, target - 1) if 0 <= t <= target - 1]


LABEL_POINTS = 7  # font size of the bound labels


def _label_bounds(ax, finals: dict, target: int, low: float, high: float) -> float:
    """Name the arms at each final bound at the right edge, pushed apart (bottom up) so that
    no two labels overlap, from the panel's size in the figure (lay the figure out first);
    returns the top of the y range (log r), raised if the labels need it."""
    fig = ax.figure
    panel_points = ax.get_position().height * fig.get_figheight() * 72
    for _ in range(3):  # a raised top shrinks the lines' height in log r: place again
        line = LABEL_POINTS * 1.3 / panel_points * (high - low)  # one text line, in log r
        placed: list[tuple[float, int]] = []  # (centre, lines)
        for v in sorted(finals):
            pos, lines = math.log(v), len(finals[v])
            if placed:
                prev, prev_lines = placed[-1]
                pos = max(pos, prev + line * ((prev_lines + lines) / 2 + 0.4))
            placed.append((pos, lines))
        needed = placed[-1][0] + line * (placed[-1][1] / 2 + 0.4)
        if needed <= high:
            break
        high = needed
    for v, (pos, _) in zip(sorted(finals), placed):
        ax.annotate(f"{v:.2f}: " + "\n".join(finals[v]), (target - 1, v), (target + 2, math.exp(pos)),
                    fontsize=LABEL_POINTS, va="center",
                    arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.6})
    return high


def seeds_figure(seeds: SeedRuns):
    """The paired-seed figure of the used runs (a matplotlib Figure; the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in seeds.arms() if seeds.usable(a)]
    colors = arm_colors(arms)
    fig, axes = plt.subplots(3, 3, figsize=(18, 13.5))
    # fixed margins, not tight_layout: as legible here, several times faster on a shared CPU,
    # and known before drawing (the bound labels are spaced from the panel's size)
    fig.subplots_adjust(left=0.055, right=0.985, bottom=0.05, top=0.925, wspace=0.5, hspace=0.3)
    curve_axes = (axes[0, 0], axes[1, 0], axes[1, 1], axes[1, 2], axes[2, 0])
    for (title, key, ylabel), ax in zip(CURVES, curve_axes):
        _curve_panel(ax, seeds, arms, colors, key)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
    _last_markers(axes[0, 0], seeds, arms, colors)
    _heldout_panel(axes[0, 1], seeds, arms, colors)
    axes[0, 1].set_title(f"held-out greedy accuracy (BF16); dotted: {HELDOUT_FROM} updates")
    axes[0, 1].set_xlabel("updates applied")
    box = axes[0, 2].get_position()
    axes[0, 2].set_position([box.x0 + FOREST_ROOM, box.y0, box.width - FOREST_ROOM, box.height])
    _forest_panel(axes[0, 2], seeds, colors)
    _phantom_panel(axes[2, 1], seeds, arms, colors)
    axes[2, 1].set_title(f"phantom clips, A<0 ({STEP_WINDOW}-step windows; steps with A<0 tokens)")
    axes[2, 1].set_ylabel("fraction of A<0 tokens")
    _bounds_panel(axes[2, 2], seeds, arms, colors)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax is not axes[0, 2] and ax is not axes[0, 1]:
            ax.set_xlabel("RL step")
    handles = [plt.Line2D([], [], color=colors[a], lw=2.5, marker=MARKERS[i % len(MARKERS)])
               for i, a in enumerate(arms)]
    fig.legend(handles, [f"{a} ({plural(len(seeds.usable(a)), 'seed')})" for a in arms], loc="upper center",
               ncol=len(arms), fontsize=10, frameon=False, bbox_to_anchor=(0.5, 0.985))
    fig.suptitle(f"paired seeds, steps 0-{seeds.target - 1}: bold = mean over seeds ({SMOOTH}-step "
                 f"rolling), {_spread_text([len(seeds.usable(a)) for a in arms])}; diamonds = "
                 f"last-{WINDOW} means", y=0.995, fontsize=11)
    return fig


def plot_seeds(seeds: SeedRuns, out_png: Path) -> Path:
    """Write the paired-seed figure of the used runs to `out_png`."""
    fig = seeds_figure(seeds)
    import matplotlib.pyplot as plt

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return out_png
