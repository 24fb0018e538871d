"""The experiment file, the arm command lines, the metrics collection, and the report's table
(against means computed here from the records) and figure."""
import json
import math

import pytest

from megatron_calibclip.config import ConfigError
from megatron_calibclip.experiment.arms import load_experiment
from megatron_calibclip.experiment.report import (BEGIN, END, arm_summary, heldout, heldout_table,
                                                  load_arms, plot_arms, summary_table, window_counts,
                                                  window_means, window_table, write_table)
from megatron_calibclip.experiment.reproduce import arm_command, collect_metrics

GOOD = """
base: tiny-cpu
set:
  run.steps: 3
  data.template: "<|im_start|>user\\n{prompt}<|im_end|>\\n"
  fp8: {format: hybrid, granularity: tensorwise}
arms:
  bf16: {precision: bf16, rollout.precision: bf16}
  fp8-block: {fp8.granularity: blockwise}
"""


def _write(tmp_path, text, name="experiment.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_arms_are_shared_settings_plus_their_own(tmp_path):
    from megatron_calibclip.trainer.config import load_train_config

    exp = load_experiment(_write(tmp_path, GOOD))
    assert list(exp.arms) == ["bf16", "fp8-block"]
    cfg = load_train_config(exp.base, exp.overrides("fp8-block"))
    assert (cfg.run.name, cfg.run.steps, cfg.fp8.granularity, cfg.fp8.format) == \
        ("fp8-block", 3, "blockwise", "hybrid")  # the arm's key wins over the shared section
    assert cfg.data.template == "<|im_start|>user\n{prompt}<|im_end|>\n"
    bf16 = load_train_config(exp.base, exp.overrides("bf16"))
    assert (bf16.precision, bf16.rollout.precision, bf16.fp8.granularity) == \
        ("bf16", "bf16", "tensorwise")
    cmd = arm_command(exp, "bf16", 2, "runs/x")
    assert cmd[1:8] == ["--standalone", "--nproc-per-node=2", "-m", "megatron_calibclip.cli",
                        "train", "--config", "tiny-cpu"]
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert sets[-2:] == ['run.name="bf16"', "run.output_dir=runs/x"]
    with pytest.raises(ConfigError, match="no arm 'fp32'"):
        exp.overrides("fp32")


@pytest.mark.parametrize("text, message", [
    ("base: tiny-cpu\narms: {}\n", "'arms' must map"),
    ("arms: {a: {}}\n", "'base' must name"),
    ("base: tiny-cpu\narms: {A B: {}}\n", "arm name 'A B'"),
    ("base: tiny-cpu\narms: {a: {run.name: x}}\n", "run.name is the arm's name"),
    ("base: tiny-cpu\nextra: 1\narms: {a: {}}\n", "unknown top-level key"),
    ("base: tiny-cpu\nset: [1]\narms: {a: {}}\n", "'set' must be a mapping"),
])
def test_bad_experiment_files_fail_in_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(_write(tmp_path, text))


def test_reproduce_rejects_a_bad_arm_before_running(tmp_path, capsys):
    from megatron_calibclip.cli import main

    path = _write(tmp_path, GOOD.replace("{fp8.granularity: blockwise}",
                                         "{fp8.granularity: blockwize}"))
    assert main(["experiment", "reproduce", "--experiment", str(path),
                 "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "arm fp8-block" in err and "blockwize" in err
    assert not (tmp_path / "runs").exists()


def _records(arm_offset):
    recs = []
    for s in range(30):
        r = {"step": s, "reward_mean": 0.1 + 0.01 * s + arm_offset,
             "loss/entropy_mean": 1.0 + (0.5 if s == 23 else 0.0) + (2.0 if s == 0 else 0.0),
             "loss/clipfrac_lower": 0.02 * (s % 3), "loss/phantom_clipfrac": 0.01,
             "loss/mult_prob_error": 0.003, "loss/kl_mean": 1e-4 * s,
             "response_length_mean": 10.0, "clip/lower": 0.8, "clip/upper": 1.2}
        if s % 10 == 0:
            r.update({"eval/accuracy": 0.3 + s / 100, "eval/updates": float(s)})
        if s == 29:
            r.update({"eval_final/accuracy": 0.7, "eval_final/updates": 30.0})
        recs.append(r)
    recs[5]["loss/phantom_clipfrac"] = None  # a step without the measurement is skipped
    return recs


def test_summary_matches_means_computed_here(tmp_path):
    recs = _records(0.0)
    s = arm_summary(recs, window=20)
    assert s["steps"] == 30
    assert s["reward_first"] == pytest.approx(sum(0.1 + 0.01 * i for i in range(20)) / 20)
    assert s["reward_last"] == pytest.approx(sum(0.1 + 0.01 * i for i in range(10, 30)) / 20)
    # the peak after the first 20 steps: step 0's higher entropy (where every run starts) is not it
    assert (s["entropy_peak"], s["entropy_peak_step"]) == (1.5, 23.0)
    assert s["phantom_first"] == pytest.approx(0.01)  # 19 finite values of 0.01
    assert (s["heldout_start"], s["heldout_end"], s["heldout_end_updates"]) == (0.3, 0.7, 30.0)
    assert heldout(recs) == [(0.0, 0.3), (10.0, 0.4), (20.0, 0.5), (30.0, 0.7)]
    table = summary_table({"a": recs, "b": _records(0.5)}, window=20)
    rows = [line for line in table.splitlines() if line.startswith("| a ") or line.startswith("| b ")]
    assert len(rows) == 2 and "1.500 (23)" in rows[0] and "0.300 -> 0.700 (after 30)" in rows[0]
    assert f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}" in rows[0]


def test_window_and_heldout_tables_match_means_computed_here():
    a, b = _records(0.0), _records(0.5)
    table = window_table({"a": a, "b": b})
    rows = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"| 0-9", "| 10-19", "| 20-29"}
    reward_10 = sum(0.1 + 0.01 * s for s in range(10, 20)) / 10
    assert f"| {reward_10:.2f} / {reward_10 + 0.5:.2f} |" in rows["| 10-19"]
    phantom = rows["| 0-9"].split(" | ")[4]  # step 5 unmeasured: 9 values of 0.01
    assert phantom == "0.010 / 0.010"
    assert " n/a / n/a " in rows["| 0-9"]  # no BF16 shadow measured in these records
    held = heldout_table({"a": a, "b": b}).splitlines()
    assert held[0] == "| arm | 0 | 10 | 20 | 30 |"
    assert held[2] == "| a | 0.30 | 0.40 | 0.50 | 0.70 |"


def test_rates_over_negative_tokens_leave_out_steps_without_any():
    recs = _records(0.0)
    for r in recs:
        r["loss/pg_loss_token_mean"] = -0.01
        r["loss/clipfrac_lower"] = 0.1
    for s in range(5):  # steps 0-4: no token with A < 0 (every group got uniform rewards)
        recs[s].update({"neg_tokens": 0.0, "loss/clipfrac_lower": 0.0})
    recs[12].update({"loss/pg_loss_token_mean": 0.0, "loss/clipfrac_lower": 0.0})  # older metrics: no neg_tokens
    recs[13]["neg_tokens"] = 40.0  # logged and nonzero
    assert window_counts(recs) == {0: 5, 10: 9, 20: 10}
    assert window_means(recs, "loss/clipfrac_lower") == {0: pytest.approx(0.1), 10: pytest.approx(0.1),
                                                         20: pytest.approx(0.1)}
    assert window_means(recs, "reward_mean")[0] == pytest.approx(sum(0.1 + 0.01 * i for i in range(10)) / 10)
    assert arm_summary(recs, window=20)["clip_neg_first"] == pytest.approx(0.1)
    row = [line for line in window_table({"a": recs}).splitlines() if line.startswith("| 0-9 |")][0]
    assert row.endswith(" | 5 |")


def test_report_collects_plots_and_fills_the_doc(tmp_path, capsys):
    from megatron_calibclip.cli import main

    runs, metrics = tmp_path / "runs", tmp_path / "exp"
    for arm, off in (("bf16", 0.0), ("fp8-tis", 0.2)):
        (runs / arm).mkdir(parents=True)
        (runs / arm / "metrics.jsonl").write_text(
            "\n".join(json.dumps(r) for r in _records(off)) + "\n")
        assert collect_metrics(runs, metrics, arm) == 30
    assert collect_metrics(runs, metrics, "missing") == 0
    assert list(load_arms(metrics)) == ["bf16", "fp8-tis"]
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Reading\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    png = tmp_path / "fig.png"
    assert main(["experiment", "report", "--metrics-dir", str(metrics), "--figure", str(png),
                 "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "old table" not in text and text.startswith("# Reading\nbefore\n")
    assert text.rstrip().endswith("after") and "| fp8-tis | 30 |" in text
    assert "| 20-29 |" in text and "| bf16 | 0.30 | 0.40 | 0.50 | 0.70 |" in text
    assert png.stat().st_size > 10_000
    assert not write_table(_write(tmp_path, "no markers", "x.md"), "t")
    assert main(["experiment", "report", "--metrics-dir", str(tmp_path / "none"),
                 "--figure", str(png), "--doc", ""]) == 2
    assert "no <arm>/metrics.jsonl" in capsys.readouterr().err


def test_survey_measures_each_candidate():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "SLURM_NTASKS")}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_calibclip.cli", "experiment", "survey",
         "--config", "tiny-cpu", "--tasks", "chain_sum-1d-2t", "chain_sum-2d-2t",
         "--problems", "16", "--group-size", "4", "--set", "rollout.sampling.max_new_tokens=3"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert list(out["tasks"]) == ["chain_sum-1d-2t", "chain_sum-2d-2t"]
    for name, res in out["tasks"].items():
        assert res["problems"] == 16 and res["task"] == "chain_sum"
        for key in ("greedy_accuracy", "sampled_accuracy"):  # 16 answers each
            assert 0.0 <= res[key] <= 1.0 and (res[key] * 16).is_integer()
        assert 0.0 <= res["mixed_groups"] <= 1.0
        assert (res["mixed_groups"] * 4).is_integer()  # 16 problems // 4 = 4 groups
        assert 1 <= res["greedy_response_length"] <= 3
    bad = subprocess.run([sys.executable, "-m", "megatron_calibclip.cli", "experiment", "survey",
                          "--tasks", "sudoku"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "unknown task(s) ['sudoku']" in bad.stderr
