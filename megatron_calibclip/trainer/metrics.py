"""Where metrics go: a JSONL file, TensorBoard events, a live progress bar (rank 0 only).

Metrics arrive already reduced over data-parallel ranks (trainer/step.py), so rank 0 alone
writes them. Non-finite values are written as null in JSON (JSON has no NaN).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from megatron_calibclip.trainer.calibration_report import mark_calibrations


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Write one JSON line per step (metrics.jsonl), TensorBoard scalars and a progress bar."""

    def __init__(self, run_dir: Path, total_steps: int, *, enabled: bool, tensorboard: bool,
                 progress: bool, start_step: int = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._fh = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a fresh run starts a fresh file; a resumed run keeps the steps before the resume
        # point (a crash may have logged steps that the checkpoint does not contain)
        kept = []
        if start_step > 0 and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", -1) < start_step]
        self._fh = self.path.open("w", encoding="utf-8")
        for r in kept:
            self._fh.write(json.dumps(r, sort_keys=True) + "\n")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="RL steps", unit="step", file=sys.stderr,
                             dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: _clean(v) for k, v in metrics.items()}
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                                  entropy=f"{metrics.get('loss/entropy_mean', float('nan')):.3f}",
                                  L=f"{metrics.get('clip/lower', float('nan')):.3f}",
                                  H=f"{metrics.get('clip/upper', float('nan')):.3f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._fh is not None:
            self._fh.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _series(records: list[dict], key: str) -> tuple[list[int], list[Optional[float]]]:
    xs, ys = [], []
    for r in records:
        if key in r and r[key] is not None:
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def plot_summary(records: list[dict], out_png: Path, title: str = "") -> Path:
    """PNG with entropy, reward, clip fractions by sign (FP8 and shadow) and [L, H] per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0][0]
    ax.plot(*_series(records, "loss/entropy_mean"), marker=".", label="entropy (mean, nats)")
    ax.set_title("entropy")
    ax = axes[0][1]
    ax.plot(*_series(records, "reward_mean"), marker=".", label="reward (mean)")
    ax.plot(*_series(records, "accuracy"), marker=".", label="accuracy")
    ax.set_title("reward")
    ax = axes[1][0]
    for key, label in [("loss/clipfrac_lower", "lower, A<0 (trainer)"),
                       ("loss/clipfrac_upper", "upper, A>0 (trainer)"),
                       ("loss/shadow_clipfrac_lower", "lower, A<0 (BF16 shadow)"),
                       ("loss/phantom_clipfrac", "phantom (FP8 only), A<0")]:
        xs, ys = _series(records, key)
        if xs:
            ax.plot(xs, ys, marker=".", label=label)
    ax.set_title("clip fractions by advantage sign")
    ax.set_xlabel("step")
    ax = axes[1][1]
    ax.plot(*_series(records, "clip/lower"), marker=".", label="L (lower ratio bound)")
    ax.plot(*_series(records, "clip/upper"), marker=".", label="H (upper ratio bound)")
    mark_calibrations(ax, records)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_title("clip bounds in force (marks: calibrations)")
    ax.set_xlabel("step")
    for row in axes:
        for a in row:
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


SUMMARY_KEYS = [
    ("reward_mean", "reward"), ("accuracy", "acc"), ("loss/entropy_mean", "entropy"),
    ("response_length_mean", "len"), ("loss/kl_mean", "KL"),
    ("loss/clipfrac_lower", "clip- A<0"), ("loss/clipfrac_upper", "clip+ A>0"),
    ("loss/phantom_clipfrac", "phantom"), ("clip/lower", "L"), ("clip/upper", "H"),
    ("loss/tis_clipfrac", "TIS clip"), ("grad_norm", "|g|"),
]


def summary_table(records: list[dict], max_rows: int = 12) -> str:
    """A short fixed-width table of the main metrics (first, some middle, last steps)."""
    if not records:
        return "(no steps)"
    if len(records) > max_rows:
        idx = sorted({round(i * (len(records) - 1) / (max_rows - 1)) for i in range(max_rows)})
        records = [records[i] for i in idx]
    header = f"{'step':>5} " + " ".join(f"{label:>9}" for _, label in SUMMARY_KEYS)
    lines = [header, "-" * len(header)]
    for r in records:
        cells = []
        for key, _ in SUMMARY_KEYS:
            v = r.get(key)
            cells.append(f"{v:>9.4f}" if isinstance(v, (int, float)) else f"{'-':>9}")
        lines.append(f"{r['step']:>5} " + " ".join(cells))
    return "\n".join(lines)


def learning_line(records: list[dict], window: int = 10) -> str:
    """'reward: first 10 steps 0.25 -> last 10 steps 0.35 (+0.10)': did RL learn?"""
    rewards = [r["reward_mean"] for r in records if r.get("reward_mean") is not None]
    if len(rewards) < 2:
        return "reward: not enough steps to compare"
    w = max(1, min(window, len(rewards) // 2))
    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    return (f"reward: first {w} steps {first:.3f} -> last {w} steps {last:.3f} "
            f"({last - first:+.3f})")
