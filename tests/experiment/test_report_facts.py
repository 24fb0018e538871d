"""The first round's facts behind the corrected reading, against means and counts computed
here from the records (rates over A<0 tokens only over the steps that had some)."""
import statistics

from megatron_calibclip.experiment.report_facts import calibration_steps, facts_table, longest_stretch


def _arm(phantom_early, phantom_late, calib=()):
    recs = []
    for s in range(100):
        neg = 0.0 if s % 5 == 4 else 100.0
        phantom = phantom_early if s < 20 else phantom_late + 0.001 * (s % 3)
        r = {"step": s, "neg_tokens": neg,
             "loss/entropy_mean": 3.0 if s == 0 else 0.1 + (0.4 if s == 87 else 0.0),
             "loss/phantom_clipfrac": phantom if neg else 0.0,
             "eos_fraction": 0.0 if s >= 20 else 1.0, "response_length_mean": 16.0 if s >= 20 else 9.0}
        recs.append(r)
    for s, ok in calib:
        recs[s].update({"calib/ran": 1.0, "calib/fallback": 0.0 if ok else 1.0})
    return recs


def test_longest_stretch_and_calibration_steps():
    assert longest_stretch([0, 1, 2, 5, 10, 40, 41, 42, 43, 50]) == (40, 43)
    assert longest_stretch([0, 10, 20]) is None
    recs = _arm(0.1, 0.02, calib=[(0, False), (1, True), (40, False), (41, False), (42, True)])
    assert calibration_steps(recs) == ([0, 1, 40, 41, 42], [1, 42])


def test_facts_table_matches_hand_means():
    arms = {"bf16": _arm(0.0, 0.0),
            "fp8-a": _arm(0.10, 0.025, calib=[(s, s == 45) for s in range(40, 46)] + [(10, True)]),
            "fp8-b": _arm(0.012, 0.019)}
    text = facts_table(arms)
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| arm")}
    for arm, recs in arms.items():
        late = statistics.fmean(r["loss/phantom_clipfrac"] for r in recs if r["step"] >= 20 and r["neg_tokens"])
        early = statistics.fmean(r["loss/phantom_clipfrac"] for r in recs if r["step"] < 20 and r["neg_tokens"])
        assert rows[arm][2:4] == [f"{early:.3f}", f"{late:.3f}"]
        assert rows[arm][4:7] == ["0.000-0.000", "16.0", "0.500 (87)"]  # step 0's 3.0 is not the peak
    assert rows["fp8-a"][7:] == ["7 (2)", "40-45: 6 steps, 1 without fallback |"]
    assert rows["bf16"][7:] == ["none", "none |"]
    lates = [statistics.fmean(r["loss/phantom_clipfrac"] for r in arms[a]
                              if r["step"] >= 20 and r["neg_tokens"]) for a in ("fp8-a", "fp8-b")]
    assert (f"Phantom clips in the FP8 arms (fp8-a, fp8-b): 1.2%-10.0% of A<0 tokens in steps 0-19, "
            f"{min(lates):.1%}-{max(lates):.1%} in steps 20-99.") in text
    assert "fp8-a: 7 calibration steps (10, 40-45), 2 without fallback (10, 45)." in text
    assert "First round: 3 arms (bf16, fp8-a, fp8-b), 100 steps each, one seed." in text
