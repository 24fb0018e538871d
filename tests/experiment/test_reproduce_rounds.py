"""Rounds and paired seeds of an experiment file: which settings each round's arms get, the
committed reproduction file (the second round = the first plus BF16 evaluation and the seed;
the L-only arm = fp8-calibrated with upper_rule host), and `reproduce --seed N` end to end on
the tiny config (folders, copied files, run_info.json, arms of one seed paired)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_calibclip.config import ConfigError, to_dict
from megatron_calibclip.experiment.arms import load_experiment, seed_root
from megatron_calibclip.trainer.config import load_train_config

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "experiments" / "reproduction" / "experiment.yaml"
FIRST_ROUND = ["fp8-tis", "bf16", "fp8-calibrated", "fp8-block-tis", "fp8-calibrated-pooled"]

TINY = """
base: tiny-cpu
set:
  run.steps: 2
  run.seed: 0
  run.tensorboard: false
  run.plot: false
  run.progress: false
  parallel.tp: 1
  data.size: 32
  data.tokenizer: "train:160"
  algorithm.group_size: 4
  algorithm.prompts_per_step: 2
  algorithm.mini_batches: 2
  algorithm.micro_batch_size: 4
  algorithm.logprob_micro_batch_size: 8
  warmup.steps: 2
  warmup.prompts_per_step: 8
  evaluation.every: 1
  evaluation.size: 8
  samples.count: 100
arms:
  a: {rollout.precision: bf16, precision: bf16, clipping.mode: fixed}
  b: {clipping.mode: fixed}
  c: {clipping.mode: calibrated}
rounds:
  first: {arms: [a, c]}
  paired: {seeded: true, set: {evaluation.precision: bf16}, arms: [a, b]}
"""


def _write(tmp_path, text):
    path = tmp_path / "experiment.yaml"
    path.write_text(text)
    return path


def _flat(cfg) -> dict:
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[prefix + k] = v
    walk(to_dict(cfg), "")
    return out


def _config(exp, arm, round_name=None, seed=None):
    round_ = exp.select_round(round_name, seed)
    return load_train_config(exp.base, exp.overrides(arm, round_, seed))


def test_the_committed_second_round_is_the_first_plus_bf16_evaluation_and_the_seed():
    exp = load_experiment(COMMITTED)
    first, second = exp.select_round(), exp.select_round("second", seed=7)
    assert (first.name, list(first.arms)) == ("first", FIRST_ROUND)  # the round that ran in 2026-12
    assert (second.name, second.seeded) == ("second", True)
    assert list(second.arms) == ["bf16", "fp8-tis", "fp8-calibrated", "fp8-calibrated-l-only"]
    for arm in FIRST_ROUND:  # the first round's arms get what they ran with: shared + their own
        cfg = _config(exp, arm)
        assert cfg.run.seed == 0 and cfg.evaluation.precision == "rollout"
    for arm in ("bf16", "fp8-tis", "fp8-calibrated"):
        before, after = _flat(_config(exp, arm)), _flat(_config(exp, arm, "second", seed=7))
        changed = {k for k in before if before[k] != after[k]}
        assert changed == {"run.seed", "evaluation.precision"}, (arm, changed)
        assert (after["run.seed"], after["evaluation.precision"]) == (7, "bf16")
    calibrated, l_only = (_flat(_config(exp, "fp8-calibrated", "second", seed=7)),
                          _flat(_config(exp, "fp8-calibrated-l-only", "second", seed=7)))
    assert {k for k in calibrated if calibrated[k] != l_only[k]} == {"run.name", "clipping.calibration.upper_rule"}
    assert (calibrated["clipping.calibration.upper_rule"], l_only["clipping.calibration.upper_rule"]) == \
        ("log_scale", "host")


def test_the_committed_third_round_is_fp8_tis_with_the_calibrated_arms_mean_bounds():
    """Issue 42's control: the round-2 settings, FP8 + TIS, and fixed bounds equal to the mean of the
    bounds fp8-calibrated had in force over its committed runs (recomputed here from them)."""
    exp = load_experiment(COMMITTED)
    third = exp.select_round(seed=7)
    assert (third.name, list(third.arms)) == ("third", ["fp8-wide-fixed"])
    tis = _flat(_config(exp, "fp8-tis", "second", seed=7))
    wide = _flat(_config(exp, "fp8-wide-fixed", "third", seed=7))
    assert {k for k in tis if tis[k] != wide[k]} == {"run.name", "clipping.fixed_lower", "clipping.fixed_upper"}
    lower, upper = [], []
    for path in sorted(COMMITTED.parent.glob("seed-*/fp8-calibrated/metrics.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        lower += [r["clip/lower"] for r in rows]
        upper += [r["clip/upper"] for r in rows]
    assert len(lower) == 300  # 3 seeds x 100 steps
    assert wide["clipping.fixed_lower"] == pytest.approx(sum(lower) / len(lower), abs=5e-4)
    assert wide["clipping.fixed_upper"] == pytest.approx(sum(upper) / len(upper), abs=5e-4)


def test_round_selection_and_its_errors(tmp_path):
    exp = load_experiment(_write(tmp_path, TINY))
    assert exp.select_round().name == "first" and exp.select_round(seed=3).name == "paired"
    with pytest.raises(ConfigError, match="round 'paired' is seeded: give --seed"):
        exp.select_round("paired")
    with pytest.raises(ConfigError, match="round 'first' has no seeds"):
        exp.select_round("first", 3)
    with pytest.raises(ConfigError, match="--seed -1"):
        exp.select_round(seed=-1)
    with pytest.raises(ConfigError, match="no round 'third'"):
        exp.select_round("third")
    # without a rounds section: one round of every arm, no seeds (files written before rounds)
    plain = load_experiment(_write(tmp_path, TINY.split("rounds:")[0]))
    assert list(plain.select_round().arms) == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="no seeded round"):
        plain.select_round(seed=1)
    assert seed_root(Path("x"), 4) == Path("x/seed-4") and seed_root(Path("x"), None) == Path("x")


@pytest.mark.parametrize("rounds, message", [
    ("rounds: {r: {arms: [z]}}\n", r"round 'r': no arm\(s\) \['z'\]"),
    ("rounds: {r: {arms: [a], extra: 1}}\n", "unknown key"),
    ("rounds: {r: {arms: []}}\n", "non-empty list"),
    ("rounds: {r: {arms: [a], seeded: yes please}}\n", "'seeded' must be true or false"),
    ("rounds: {r: {arms: [a], seeded: true, set: {run.seed: 3}}}\n", "run.seed comes from --seed"),
    ("rounds: {r: {arms: [a], set: {run.name: q}}}\n", "run.name is the arm's name"),
    ("rounds: [a]\n", "'rounds' must map"),
])
def test_bad_rounds_fail_in_one_line(tmp_path, rounds, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(_write(tmp_path, TINY.split("rounds:")[0] + rounds))


def test_reproduce_refuses_bad_seeds_rounds_and_arms_before_running(tmp_path, capsys):
    from megatron_calibclip.cli import main

    path = _write(tmp_path, TINY)
    for extra, words in ((["--round", "paired"], "give --seed"), (["--seed", "1", "--arms", "a,c"], "no arm(s) ['c']"),
                         (["--seed", "1", "--round", "first"], "has no seeds")):
        rc = main(["experiment", "reproduce", "--experiment", str(path), "--runs-dir", str(tmp_path / "runs"),
                   *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "runs").exists()


def _git_head() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_reproduce_with_a_seed_runs_paired_arms_and_records_what_ran(tmp_path):
    path = _write(tmp_path, TINY)
    runs, out = tmp_path / "runs", tmp_path / "out"
    cmd = [sys.executable, "-m", "megatron_calibclip.cli", "experiment", "reproduce", "--experiment", str(path),
           "--seed", "5", "--arms", "a,b", "--nproc", "1", "--runs-dir", str(runs), "--metrics-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for arm in ("a", "b"):
        run_dir, copied = runs / "seed-5" / arm, out / "seed-5" / arm
        assert sorted(p.name for p in copied.iterdir()) == ["metrics.jsonl", "run_info.json", "samples.jsonl"]
        for name in ("metrics.jsonl", "samples.jsonl", "run_info.json"):
            assert (copied / name).read_bytes() == (run_dir / name).read_bytes()
        info = json.loads((copied / "run_info.json").read_text())
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert (info["round"], info["arm"], info["seed"], info["steps"]) == ("paired", arm, 5, 2)
        assert info["commit"] == _git_head() and info["commits"] == [_git_head()]
        assert info["config"] == config and config["run"]["seed"] == 5
        assert config["evaluation"]["precision"] == "bf16" and info["resolved"]["device"] == "cpu"
        [segment] = info["segments"]
        assert (segment["steps_before"], segment["steps_after"], segment["exit_code"]) == (0, 2, 0)
        assert segment["commit_from"] == "trainer"
        records = [json.loads(line) for line in (copied / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0, 1] and records[0]["eval/precision"] == "bf16"
    # arms of one seed are paired: the same prompts in the same order at every step
    a, b = _samples(out / "seed-5" / "a"), _samples(out / "seed-5" / "b")
    assert [(s["step"], s["group"], s["prompt"]) for s in a] == [(s["step"], s["group"], s["prompt"]) for s in b]
    assert len(a) == 2 * 2 * 4  # steps x prompts x answers (count 100 > the batch)


def test_run_info_keeps_every_start_that_trained_or_failed(tmp_path):
    from megatron_calibclip.experiment.reproduce import run_info_record

    exp = load_experiment(_write(tmp_path, TINY))
    round_ = exp.select_round(seed=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run: {seed: 2}\n")
    (run_dir / "resolved.yaml").write_text("device: cpu\ncode.commit: abc\ncode.dirty: 'false'\n")

    def start(steps_before, steps_after, commit, rc=0):
        (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in range(steps_after)))
        segment = {"commit": commit, "dirty": "false", "exit_code": rc, "steps_before": steps_before,
                   "steps_after": steps_after}
        info = run_info_record(run_dir, experiment=Path("e.yaml"), round_=round_, arm="a", seed=2,
                               overrides=exp.overrides("a", round_, 2), segment=segment)
        (run_dir / "run_info.json").write_text(json.dumps(info))
        return info

    info = start(0, 2, "abc")
    assert (info["commit"], info["commits"], info["steps"], len(info["segments"])) == ("abc", ["abc"], 2, 1)
    assert info["config"] == {"run": {"seed": 2}} and info["resolved"] == {"device": "cpu"}
    assert 'run.seed=2' in info["overrides"] and not info["dirty"]
    assert len(start(2, 2, "abc")["segments"]) == 1  # an arm already done: nothing ran, nothing recorded
    failed = start(2, 2, "def", rc=1)  # a start that failed is recorded, but ran no step
    assert len(failed["segments"]) == 2 and failed["commit"] == "abc"
    mixed = start(2, 4, "def")  # resumed at another commit: no single commit
    assert mixed["commit"] is None and mixed["commits"] == ["abc", "def"] and mixed["steps"] == 4


def _run_dir(path: Path, steps: int, checkpoint: bool) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in range(steps)))
    if checkpoint:
        (path / "checkpoints").mkdir()
        (path / "checkpoints" / "latest").write_text("step_00000005\n")
    return path


def test_an_arm_stopped_before_its_first_checkpoint_is_moved_aside_not_lost(tmp_path):
    from megatron_calibclip.experiment.reproduce import set_aside_unresumable

    stopped = _run_dir(tmp_path / "seed-1" / "a", 3, checkpoint=False)
    aside = set_aside_unresumable(stopped, steps=100)
    assert aside == tmp_path / "seed-1" / "a.no-checkpoint-1" and not stopped.exists()
    assert (aside / "metrics.jsonl").read_text().count("\n") == 3  # kept, not deleted
    again = _run_dir(stopped, 2, checkpoint=False)  # stopped early a second time
    assert set_aside_unresumable(again, steps=100).name == "a.no-checkpoint-2"
    # resumable, finished, or never started: left where the trainer finds them
    resumable = _run_dir(tmp_path / "seed-1" / "b", 7, checkpoint=True)
    finished = _run_dir(tmp_path / "seed-1" / "c", 100, checkpoint=False)
    assert set_aside_unresumable(resumable, steps=100) is None and resumable.exists()
    assert set_aside_unresumable(finished, steps=100) is None and finished.exists()
    assert set_aside_unresumable(tmp_path / "seed-1" / "d", steps=100) is None


def test_reproduce_restarts_an_arm_that_has_no_checkpoint(tmp_path, monkeypatch, capsys):
    """Re-running the command after an arm was stopped before its first save starts that arm
    over (the trainer alone would refuse its directory on every re-run)."""
    import megatron_calibclip.experiment.reproduce as reproduce
    from megatron_calibclip.cli import build_parser

    path = _write(tmp_path, TINY)
    runs, out = tmp_path / "runs", tmp_path / "out"
    _run_dir(runs / "seed-5" / "a", 1, checkpoint=False)  # TINY runs 2 steps
    seen = []

    def fake_train(cmd, env=None):
        run_dir = runs / "seed-5" / "a"
        seen.append(run_dir.exists())
        _run_dir(run_dir, 2, checkpoint=True)
        return 0

    monkeypatch.setattr(reproduce.subprocess, "call", fake_train)
    args = build_parser().parse_args(["experiment", "reproduce", "--experiment", str(path), "--seed", "5",
                                      "--arms", "a", "--runs-dir", str(runs), "--metrics-dir", str(out)])
    assert reproduce.run_reproduce(args) == 0
    assert seen == [False]  # the trainer got an empty place
    assert (runs / "seed-5" / "a.no-checkpoint-1" / "metrics.jsonl").read_text().count("\n") == 1
    assert json.loads((out / "seed-5" / "a" / "run_info.json").read_text())["steps"] == 2
    assert "held 1 steps of metrics but no checkpoint to resume from; moved to" in capsys.readouterr().out
