"""The run-end calibration report: which calibrations succeeded, in text and on the plot."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megatron_calibclip.trainer.calibration_report import (  # noqa: E402
    calibration_line,
    calibration_table,
    mark_calibrations,
)
from megatron_calibclip.trainer.metrics import plot_summary  # noqa: E402


def _records():
    ok = {"calib/ran": 1.0, "calib/fallback": 0.0, "calib/fallback_reason": "",
          "calib/upper_rule": "log_scale", "calib/n_neg": 300.0, "calib/n_neg_clipped_shadow": 40.0, "calib/alpha": 40 / 300}
    fb = {"calib/ran": 1.0, "calib/fallback": 1.0, "calib/upper_rule": "log_scale",
          "calib/fallback_reason": "too_few_clipped_negative: the shadow clips 3 of 90 ...",
          "calib/n_neg": 90.0, "calib/n_neg_clipped_shadow": 3.0, "calib/lower_raw": float("nan")}
    return [
        {"step": 0, **ok, "calib/lower_raw": 0.71, "calib/upper_raw": 1.32,
         "calib/lower_next": 0.71, "calib/upper_next": 1.32, "clip/lower": 0.6, "clip/upper": 1.8},
        {"step": 1, "clip/lower": 0.71, "clip/upper": 1.32},
        {"step": 2, **fb, "calib/lower_next": 0.71, "calib/upper_next": 1.32,
         "clip/lower": 0.71, "clip/upper": 1.32},
        {"step": 3, "clip/lower": 0.71, "clip/upper": 1.32},
        {"step": 4, **ok, "calib/lower_raw": 0.75, "calib/upper_raw": 1.26,
         "calib/lower_next": 0.73, "calib/upper_next": 1.29, "clip/lower": 0.71, "clip/upper": 1.32},
    ]


def test_line_counts_successes_and_reasons():
    assert calibration_line(_records()) == ("calibrations: 2 of 3 succeeded (67%); "
                                            "fallbacks: too_few_clipped_negative x1")
    assert calibration_line([{"step": 0}]) == "calibrations: none ran"


def test_table_has_one_row_per_calibration_with_its_outcome():
    lines = calibration_table(_records()).splitlines()
    rows = lines[2:]
    assert [int(r.split()[0]) for r in rows] == [0, 2, 4]
    assert rows[0].endswith("  ok") and rows[2].endswith("  ok")
    assert rows[1].endswith("fallback: too_few_clipped_negative")
    assert "0.7100" in rows[0] and "1.3200" in rows[0]  # L*, H* and the bounds next
    assert rows[1].split()[3] == "3"  # k(N): BF16-clipped negative tokens
    assert "-" in rows[1].split()[7]  # no L* on a fallback (NaN shows as '-')


def test_marks_on_the_bounds_axis_at_the_step_they_take_effect():
    fig, ax = plt.subplots()
    mark_calibrations(ax, _records())
    offsets = [np.asarray(c.get_offsets()) for c in ax.collections]
    colors = [c.get_facecolor()[0][:3] for c in ax.collections]
    plt.close(fig)
    ok_lower, ok_upper, fb_lower, fb_upper = offsets
    assert ok_lower.tolist() == [[1, 0.71], [5, 0.73]] and ok_upper.tolist() == [[1, 1.32], [5, 1.29]]
    assert fb_lower.tolist() == [[3, 0.71]] and fb_upper.tolist() == [[3, 1.32]]
    assert colors[0][1] > colors[0][0] and colors[2][0] > colors[2][1]  # green, then red


def test_summary_plot_carries_the_marks(tmp_path):
    png = plot_summary(_records(), tmp_path / "s.png")
    assert png.stat().st_size > 10_000
