"""The Calibrations table of the second round's report: each used calibrated run's
calibrations (taken from metrics records the test writes), what the effective ones rest on,
and the summary's counts checked against the injected values."""
import json

from megatron_calibclip.experiment.report_calibrations import calibration_table, calibrations
from megatron_calibclip.experiment.report_seeds import load_seeds

from .seed_runs import write_run, write_seeds

# step -> (fallback reason text or "", BF16-clipped A<0 tokens k, A<0 tokens n, L*)
SEED_1 = {0: ("alpha_zero: the shadow clips no negative token (r <= 0.8)", 0, 199, None),
          10: ("", 3, 221, 0.4238), 20: ("", 1, 112, 0.3360),
          30: ("no_negative_tokens: no valid token has A < 0", 0, 0, None),
          40: ("lower_out_of_range: the calibrated L* = 0.0183 is outside", 1, 160, 0.0183)}
SEED_2 = {0: ("", 1, 428, 0.1006), 10: ("alpha_zero: the shadow clips none", 0, 112, None)}


def _inject(folder, seed, arm, cals, last_bounds):
    """Add calib/* keys to the given steps and the bounds in force to the last step."""
    path = folder / f"seed-{seed}" / arm / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        if r["step"] in cals:
            reason, k, n, lower = cals[r["step"]]
            r.update({"calib/ran": 1.0, "calib/fallback": 1.0 if reason else 0.0,
                      "calib/fallback_reason": reason, "calib/n_neg_clipped_shadow": float(k),
                      "calib/n_neg": float(n), "calib/lower_raw": lower})
    recs[-1]["clip/lower"], recs[-1]["clip/upper"] = last_bounds
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _folder(tmp_path):
    folder = tmp_path / "exp"
    write_seeds(folder, seeds=(1, 2), arms=("bf16", "fp8-tis", "fp8-calibrated"))
    _inject(folder, 1, "fp8-calibrated", SEED_1, (0.3776, 2.2171))
    _inject(folder, 2, "fp8-calibrated", SEED_2, (0.1006, 6.5318))
    write_run(folder, 2, "fp8-calibrated-l-only", steps=40)  # still running: not used
    _inject(folder, 2, "fp8-calibrated-l-only", {0: ("", 7, 288, 0.533)}, (0.533, 1.2))
    return folder


def test_calibrations_of_a_run_in_step_order(tmp_path):
    seeds = load_seeds(_folder(tmp_path))
    cals = calibrations(seeds.runs[(1, "fp8-calibrated")].records)
    assert [c.step for c in cals] == sorted(SEED_1)
    assert [c.reason for c in cals] == ["alpha_zero", "", "", "no_negative_tokens", "lower_out_of_range"]
    assert [c.took_effect for c in cals] == [False, True, True, False, False]
    assert [(c.clipped, c.negatives) for c in cals] == [(k, n) for _, k, n, _ in SEED_1.values()]
    assert calibrations(seeds.runs[(1, "bf16")].records) == []


def test_table_rows_and_summary(tmp_path):
    text = calibration_table(load_seeds(_folder(tmp_path)))
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows == [
        "| 1 | fp8-calibrated | 5 | step 10: 3 of 221, L* 0.424; step 20: 1 of 112, L* 0.336 | "
        "3: alpha_zero 1, lower_out_of_range 1, no_negative_tokens 1 | 0.378, 2.217 |",
        "| 2 | fp8-calibrated | 2 | step 0: 1 of 428, L* 0.101 | 1: alpha_zero 1 | 0.101, 6.532 |",
    ]  # the running L-only arm (40 of 100 steps) is not used, so not listed
    # effective: k = 3, 1, 1 -> two single-token calibrations of three, range 1-3, median 1
    assert "Of the 3 calibrations that took effect, 2 rested on a single" in text
    assert "k ranged 1-3, median 1." in text
    # an L* near 1 (seed 2000's step 40 read 0.991) is not the L set: widen-only, then smoothing
    assert "L = min(L*, 1 - eps_low) (widen-only)" in text and "never above it" in text


def test_no_calibrated_run(tmp_path):
    folder = write_seeds(tmp_path / "exp", seeds=(1, 2), arms=("bf16", "fp8-tis"))
    assert calibration_table(load_seeds(folder)) == "No used run calibrates yet."


def test_calibrated_run_whose_calibrations_all_fell_back(tmp_path):
    folder = write_seeds(tmp_path / "exp", seeds=(1,), arms=("fp8-calibrated",))
    _inject(folder, 1, "fp8-calibrated", {0: ("alpha_zero: none", 0, 10, None),
                                          50: ("", 0, 0, None)}, (0.6, 1.8))
    # step 50: flagged a fallback without a reason text -> "unknown"
    path = folder / "seed-1" / "fp8-calibrated" / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    recs[50]["calib/fallback"] = 1.0
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = calibration_table(load_seeds(folder))
    assert "| 1 | fp8-calibrated | 2 | none | 2: alpha_zero 1, unknown 1 | 0.600, 1.800 |" in text
    assert text.endswith("No calibration of the used runs took effect: their bounds are the "
                         "initial ones throughout.")
