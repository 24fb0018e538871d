"""What the calibrations of a run did, for a person: a table, one summary line, plot marks.

The numbers are in metrics.jsonl (calib/* on calibration steps, written by trainer/step.py);
this module only reads records, so it also serves a finished run's metrics file.
"""
from __future__ import annotations

from collections import Counter
from typing import Any


def calibration_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of calibration steps (those that ran a BF16 shadow and the estimator)."""
    return [r for r in records if r.get("calib/ran")]


def succeeded(record: dict[str, Any]) -> bool:
    return record.get("calib/fallback") == 0.0


def _short_reason(record: dict[str, Any]) -> str:
    reason = record.get("calib/fallback_reason") or ""
    return reason.split(":", 1)[0]


def calibration_line(records: list[dict[str, Any]]) -> str:
    """'calibrations: 22 of 25 succeeded; fallbacks: too_few_clipped_negative x3'."""
    calib = calibration_records(records)
    if not calib:
        return "calibrations: none ran"
    ok = sum(succeeded(r) for r in calib)
    line = f"calibrations: {ok} of {len(calib)} succeeded ({100.0 * ok / len(calib):.0f}%)"
    reasons = Counter(_short_reason(r) for r in calib if not succeeded(r))
    if reasons:
        line += "; fallbacks: " + ", ".join(f"{k} x{v}" for k, v in reasons.most_common())
    return line


def _cell(value: Any, fmt: str, width: int) -> str:
    if isinstance(value, (int, float)) and value == value:  # not NaN
        return format(value, fmt).rjust(width)
    return "-".rjust(width)


def calibration_table(records: list[dict[str, Any]]) -> str:
    """One row per calibration: counts, the raw L*/H* the rule found, the bounds in force
    next, and whether it succeeded (else the fallback reason's code)."""
    calib = calibration_records(records)
    if not calib:
        return "(no calibration steps)"
    cols = [("step", 5), ("rule", 11), ("N", 6), ("k(N)", 5), ("alpha", 7), ("P", 6),
            ("k(P)", 5), ("L*", 7), ("H*", 7), ("L next", 7), ("H next", 7)]
    header = " ".join(name.rjust(w) for name, w in cols) + "  result"
    lines = [header, "-" * len(header)]
    for r in calib:
        cells = [
            str(r["step"]).rjust(5), str(r.get("calib/upper_rule", "-")).rjust(11),
            _cell(r.get("calib/n_neg"), ".0f", 6), _cell(r.get("calib/n_neg_clipped_shadow"), ".0f", 5),
            _cell(r.get("calib/alpha"), ".4f", 7), _cell(r.get("calib/n_pos"), ".0f", 6),
            _cell(r.get("calib/n_pos_clipped_shadow"), ".0f", 5),
            _cell(r.get("calib/lower_raw"), ".4f", 7), _cell(r.get("calib/upper_raw"), ".4f", 7),
            _cell(r.get("calib/lower_next"), ".4f", 7), _cell(r.get("calib/upper_next"), ".4f", 7),
        ]
        result = "ok" if succeeded(r) else f"fallback: {_short_reason(r) or '?'}"
        lines.append(" ".join(cells) + "  " + result)
    return "\n".join(lines)


def mark_calibrations(ax, records: list[dict[str, Any]]) -> None:
    """On a bounds-per-step axis: each calibration at the bounds it set for the next step,
    a filled dot where it succeeded and a red cross where it fell back (bounds kept)."""
    calib = calibration_records(records)
    for ok, style in ((True, dict(marker="o", color="tab:green", label="calibration succeeded")),
                      (False, dict(marker="x", color="tab:red", label="calibration fell back"))):
        rows = [r for r in calib if succeeded(r) == ok and r.get("calib/lower_next") is not None]
        if not rows:
            continue
        xs = [r["step"] + 1 for r in rows]  # the bounds take effect from the next step
        ax.scatter(xs, [r["calib/lower_next"] for r in rows], s=28, zorder=3, **style)
        ax.scatter(xs, [r["calib/upper_next"] for r in rows], s=28, zorder=3,
                   **{k: v for k, v in style.items() if k != "label"})
