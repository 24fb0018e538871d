"""The first round of `calibclip experiment report`: the arms overlaid in one figure, and
tables of the arms (first/last means, 10-step windows side by side, held-out accuracy);
also the document's generated sections (`write_section`) and the series helpers the second
round (report_seeds) reuses.

Reads only the committed `<arm>/metrics.jsonl` files, so the figure and the table regenerate
anywhere with one command. Each table goes between two marker lines of the document
(`--doc`), leaving the hand-written reading around it untouched. The command itself is
report_run.run_report.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from megatron_calibclip.trainer.metrics import read_metrics

TABLE_SECTION = "reproduction-table"  # the first round's tables in the document
BEGIN, END = f"<!-- {TABLE_SECTION}:begin -->", f"<!-- {TABLE_SECTION}:end -->"
WINDOW = 20  # first / last steps averaged in the table
SMOOTH = 5  # rolling mean drawn over the raw per-step values

PANELS = [  # (title, [(key, label suffix)], y-label)
    ("entropy (mean over response tokens)", [("loss/entropy_mean", "")], "nats"),
    ("training reward (sampled)", [("reward_mean", "")], "mean reward"),
    ("held-out greedy accuracy", [], "accuracy"),
    ("clipped, A<0 (trainer)", [("loss/clipfrac_lower", "")], "fraction of A<0 tokens"),
    ("phantom clips, A<0 (vs BF16 shadow)", [("loss/phantom_clipfrac", "")],
     "fraction of A<0 tokens"),
    ("clip bounds in force", [("clip/lower", " L"), ("clip/upper", " H")], "ratio"),
]


def load_arms(folder: Path) -> dict[str, list[dict]]:
    """{arm: records} for every <folder>/<arm>/metrics.jsonl, in name order (the first round;
    the second round's seed-<n>/ folders are read by report_seeds)."""
    arms = {}
    for path in sorted(Path(folder).glob("*/metrics.jsonl")):
        if path.parent.name.startswith("seed-"):
            continue
        records = [r for r in read_metrics(path) if "step" in r]
        if records:
            arms[path.parent.name] = sorted(records, key=lambda r: r["step"])
    return arms


# rates over the tokens with A < 0: a step without any reads 0.0 in metrics.jsonl and is left
# out of their means and curves (otherwise late, low-entropy steps whose groups all got the
# same reward would pull the rates toward 0)
NEG_RATES = ("loss/clipfrac_lower", "loss/phantom_clipfrac", "loss/shadow_clipfrac_lower")
# likewise over the tokens with A > 0 (a step without any: left out)
POS_RATES = ("loss/clipfrac_upper", "loss/shadow_clipfrac_upper")


def has_negative_tokens(record: dict) -> bool:
    """Whether the step trained on any token with A < 0: `neg_tokens` where logged; in older
    metrics, a policy-gradient loss of exactly 0 (every advantage 0) means none."""
    if isinstance(record.get("neg_tokens"), (int, float)):
        return float(record["neg_tokens"]) > 0
    return record.get("loss/pg_loss_token_mean") != 0.0


def values_by_step(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the finite values of `key`; rates over A<0 (A>0) tokens only where some."""
    return [(r["step"], float(r[key])) for r in records
            if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))
            and (key not in NEG_RATES or has_negative_tokens(r))
            and (key not in POS_RATES or float(r.get("pos_tokens", 1.0)) > 0)]


def mean_of(pairs: list[tuple[int, float]]) -> Optional[float]:
    """Mean of the values of (step, value) pairs; None for none. math.fsum: correctly rounded,
    so the report reads the same under every Python (3.12's sum() compensates, 3.11's does not,
    and a mean on a rounding tie then prints differently)."""
    return math.fsum(v for _, v in pairs) / len(pairs) if pairs else None


def heldout(records: list[dict]) -> list[tuple[float, float]]:
    """(updates applied, held-out accuracy) of every evaluation, the final one included."""
    points = [(float(r["eval/updates"]), float(r["eval/accuracy"])) for r in records
              if r.get("eval/accuracy") is not None]
    points += [(float(r["eval_final/updates"]), float(r["eval_final/accuracy"])) for r in records
               if r.get("eval_final/accuracy") is not None]
    return sorted(points)


def arm_summary(records: list[dict], window: int = WINDOW) -> dict[str, Optional[float]]:
    """First/last-`window`-step means of the key series, peak entropy after the first `window`
    steps (entropy starts at its maximum, so a peak over all steps would always read step 0),
    held-out accuracy."""
    out: dict[str, Optional[float]] = {"steps": float(len(records))}
    steps = [r["step"] for r in records]
    first_end, last_start = min(steps, default=0) + window, max(steps, default=0) - window
    for key, name in (("reward_mean", "reward"), ("loss/entropy_mean", "entropy"),
                      ("loss/clipfrac_lower", "clip_neg"), ("loss/phantom_clipfrac", "phantom"),
                      ("loss/mult_prob_error", "mult_err"), ("loss/kl_mean", "kl"),
                      ("response_length_mean", "length")):
        series = values_by_step(records, key)  # by step: the first / last `window` steps, not values
        out[f"{name}_first"] = mean_of([p for p in series if p[0] < first_end])
        out[f"{name}_last"] = mean_of([p for p in series if p[0] > last_start])
    ent = [p for p in values_by_step(records, "loss/entropy_mean") if p[0] >= first_end]
    peak = max(ent, key=lambda p: p[1]) if ent else None
    out["entropy_peak"], out["entropy_peak_step"] = (peak[1], float(peak[0])) if peak else (None, None)
    points = heldout(records)
    out["heldout_start"] = points[0][1] if points else None
    out["heldout_end"] = points[-1][1] if points else None
    out["heldout_end_updates"] = points[-1][0] if points else None
    return out


def ranges(values: list[int]) -> str:
    """'0-99' or '1-3, 5' for sorted integers."""
    out, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(v) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out) or "none"


def _fmt(v: Optional[float], digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def summary_table(arms: dict[str, list[dict]], window: int = WINDOW) -> str:
    """Markdown: one row per arm (first -> last `window`-step means)."""
    head = (f"| arm | steps | reward | entropy | peak entropy, steps {window}+ (step) "
            "| clipped A<0 | phantom A<0 | mult. prob. error | KL to ref | held-out acc. start -> end |")
    rows = [head, "|" + "---|" * 10]
    for arm, records in arms.items():
        s = arm_summary(records, window)

        def pair(name: str, digits: int = 3) -> str:
            return f"{_fmt(s[f'{name}_first'], digits)} -> {_fmt(s[f'{name}_last'], digits)}"

        peak = (f"{_fmt(s['entropy_peak'])} ({int(s['entropy_peak_step'])})"
                if s["entropy_peak"] is not None else "n/a")
        acc = f"{_fmt(s['heldout_start'])} -> {_fmt(s['heldout_end'])}"
        if s["heldout_end_updates"] is not None:
            acc += f" (after {int(s['heldout_end_updates'])})"
        rows.append(f"| {arm} | {int(s['steps'])} | {pair('reward')} | {pair('entropy')} | {peak} "
                    f"| {pair('clip_neg')} | {pair('phantom')} | {pair('mult_err', 4)} "
                    f"| {pair('kl', 5)} | {acc} |")
    return "\n".join(rows) + (f"\n\nFirst -> last {window}-step means (A<0 rates: over the steps "
                              f"with A<0 tokens); held-out accuracy before the first and after the "
                              f"last update.")


STEP_WINDOW = 10  # width of the windows in the per-window table
WINDOW_COLUMNS = [("reward_mean", "reward", 2), ("loss/entropy_mean", "entropy", 3),
                  ("loss/clipfrac_lower", "clipped A<0", 3),
                  ("loss/phantom_clipfrac", "phantom A<0", 3),
                  ("loss/shadow_clipfrac_lower", "BF16 shadow clipped A<0", 3),
                  ("loss/mult_prob_error", "mult. prob. error", 2),
                  ("response_length_mean", "length", 1)]


def window_means(records: list[dict], key: str, width: int = STEP_WINDOW
                 ) -> dict[int, Optional[float]]:
    """{first step of the window: mean of `key` over the window's finite values}."""
    last = max((r["step"] for r in records), default=-1)
    series = values_by_step(records, key)
    return {start: mean_of([p for p in series if start <= p[0] < start + width])
            for start in range(0, last + 1, width)}


def window_counts(records: list[dict], width: int = STEP_WINDOW) -> dict[int, int]:
    """{first step of the window: steps in it that trained on a token with A < 0}."""
    last = max((r["step"] for r in records), default=-1)
    return {start: sum(1 for r in records if start <= r["step"] < start + width and has_negative_tokens(r))
            for start in range(0, last + 1, width)}


def window_table(arms: dict[str, list[dict]], width: int = STEP_WINDOW) -> str:
    """Markdown: one row per `width`-step window, each column the arms side by side."""
    names = list(arms)
    head = ("| steps | " + " | ".join(f"{label} ({' / '.join(names)})" for _, label, _ in WINDOW_COLUMNS)
            + f" | steps with A<0 tokens ({' / '.join(names)}) |")
    rows = [head, "|" + "---|" * (len(WINDOW_COLUMNS) + 2)]
    means = {(arm, key): window_means(recs, key, width)
             for arm, recs in arms.items() for key, _, _ in WINDOW_COLUMNS}
    counts = {arm: window_counts(recs, width) for arm, recs in arms.items()}
    starts = sorted({s for m in means.values() for s in m})
    for start in starts:
        cells = [" / ".join(_fmt(means[(arm, key)].get(start), digits) for arm in names)
                 for key, _, digits in WINDOW_COLUMNS]
        cells.append(" / ".join(str(counts[arm][start]) if start in counts[arm] else "n/a" for arm in names))
        rows.append(f"| {start}-{start + width - 1} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + (f"\n\n{width}-step means per arm (n/a: not measured in that arm). "
                              "Rates over A<0 tokens average only the steps that had some (last column: "
                              "how many; a step whose groups all got uniform rewards has none).")


def heldout_table(arms: dict[str, list[dict]]) -> str:
    """Markdown: held-out greedy accuracy of each arm after each number of updates."""
    points = {arm: dict(heldout(recs)) for arm, recs in arms.items()}
    updates = sorted({u for p in points.values() for u in p})
    rows = ["| arm | " + " | ".join(str(int(u)) for u in updates) + " |",
            "|" + "---|" * (len(updates) + 1)]
    for arm, p in points.items():
        rows.append(f"| {arm} | " + " | ".join(_fmt(p.get(u), 2) for u in updates) + " |")
    return "\n".join(rows) + ("\n\nHeld-out greedy accuracy (in the arm's rollout precision) "
                              "after the number of updates in the header.")


def report_tables(arms: dict[str, list[dict]]) -> str:
    """Everything `report` writes between the markers: summary, windows, held-out."""
    return "\n\n".join((summary_table(arms), window_table(arms), heldout_table(arms)))


def rolling_mean(ys: list[float], n: int) -> list[float]:
    """Mean of each value and the up to n - 1 before it (the curves' smoothing)."""
    return [math.fsum(ys[max(0, i - n + 1): i + 1]) / len(ys[max(0, i - n + 1): i + 1])
            for i in range(len(ys))]


def plot_arms(arms: dict[str, list[dict]], out_png: Path, title: str = "") -> Path:
    """The panels of PANELS with every arm overlaid (thin: per step; bold: rolling mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (panel_title, keys, ylabel), ax in zip(PANELS, axes.flat):
        for i, (arm, records) in enumerate(arms.items()):
            color = colors[i % len(colors)]
            if not keys:  # held-out accuracy: points at the evaluations
                pts = heldout(records)
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=color, label=arm)
                continue
            for key, suffix in keys:
                pts = values_by_step(records, key)
                if not pts:
                    continue
                xs, ys = zip(*pts)
                style = "--" if suffix.strip() == "H" else "-"
                ax.plot(xs, ys, style, color=color, alpha=0.25, lw=0.8)
                ax.plot(xs, rolling_mean(list(ys), SMOOTH), style, color=color, lw=1.8,
                        label=f"{arm}{suffix}")
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("RL step (held-out: updates applied)")
    fig.suptitle(title or f"arms overlaid; bold: {SMOOTH}-step rolling mean")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def markers(name: str) -> tuple[str, str]:
    """The begin / end marker lines of a generated section of the document."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(doc: Path, name: str, text: str) -> bool:
    """Replace the text between the `name` markers of `doc`; False if the markers are absent.
    The document is rewritten only when the text changed (a second run leaves it untouched)."""
    begin, end = markers(name)
    old = doc.read_text(encoding="utf-8")
    if begin not in old or end not in old or old.index(begin) > old.index(end):
        return False
    head, rest = old.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{begin}\n{text}\n{end}{tail}"
    if new != old:
        doc.write_text(new, encoding="utf-8")
    return True


def write_table(doc: Path, table: str) -> bool:
    """The first round's tables between BEGIN and END (see write_section)."""
    return write_section(doc, TABLE_SECTION, table)
