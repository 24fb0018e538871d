"""`calibclip experiment reproduce`: run the arms of one round of an experiment file.

Each arm is an ordinary `calibclip train` run under torchrun (run.name = the arm), so it is
resumable: run the command again and every arm continues from its newest checkpoint; a
finished arm is skipped by the trainer ("N steps already done"); an arm stopped before its
first checkpoint is moved aside (`<arm>.no-checkpoint-N`) and starts over. After each arm (also when
it stopped early) its small files are copied next to the experiment file, where they are
committed and `calibclip experiment report` reads them:

    round without seeds:      runs/<arm>/         -> <folder>/<arm>/metrics.jsonl
    seeded round, --seed N:   runs/seed-N/<arm>/  -> <folder>/seed-N/<arm>/{metrics.jsonl,
                                                      samples.jsonl, run_info.json}

run_info.json says what ran (run_info_record): the commit of every start that trained steps
(read from the run's resolved.yaml, which the trainer writes on each start), the seed, the
overrides and the run's resolved configuration (config.yaml and resolved.yaml).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_calibclip.config import ConfigError
from megatron_calibclip.experiment.arms import Experiment, Round, load_experiment, seed_root

RUN_INFO = "run_info.json"
RUN_INFO_FORMAT = "megatron_calibclip.run_info/1"


def _check_arms(exp: Experiment, arms: list[str], runs_dir: str, round_: Optional[Round] = None,
                seed: Optional[int] = None) -> dict[str, int]:
    """Every arm's configuration loads (mistakes surface before hours of compute); returns
    each arm's ``run.steps``."""
    from megatron_calibclip.trainer.config import load_train_config

    steps = {}
    for arm in arms:
        try:
            config = load_train_config(exp.base, exp.overrides(arm, round_, seed) + [f"run.output_dir={runs_dir}"])
        except ConfigError as err:
            raise ConfigError(f"arm {arm}: {err}") from None
        steps[arm] = config.run.steps
    return steps


def arm_command(exp: Experiment, arm: str, nproc: int, runs_dir: str, round_: Optional[Round] = None,
                seed: Optional[int] = None) -> list[str]:
    """The torchrun command line of one arm (`runs_dir`: its run.output_dir)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "megatron_calibclip.cli", "train",
           "--config", exp.base]
    for text in exp.overrides(arm, round_, seed) + [f"run.output_dir={runs_dir}"]:
        cmd += ["--set", text]
    return cmd


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open(encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip())


def collect_metrics(runs_dir: Path, metrics_dir: Path, arm: str) -> int:
    """Copy an arm's metrics.jsonl next to the experiment; returns its step count."""
    src = runs_dir / arm / "metrics.jsonl"
    if not src.exists():
        return 0
    dst = metrics_dir / arm / "metrics.jsonl"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return _count_lines(dst)


def _read_yaml(path: Path) -> Optional[dict]:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    except yaml.YAMLError:
        return None


def run_info_record(run_dir: Path, *, experiment: Path, round_: Round, arm: str, seed: int,
                    overrides: list[str], segment: dict[str, Any]) -> dict[str, Any]:
    """run_info.json of an arm after one start: the earlier starts (from the run directory's
    copy) plus `segment` when it trained steps or failed, with the run's current config."""
    old = {}
    if (run_dir / RUN_INFO).exists():
        old = json.loads((run_dir / RUN_INFO).read_text(encoding="utf-8"))
    segments = list(old.get("segments", []))
    if segment["steps_after"] > segment["steps_before"] or segment["exit_code"] != 0:
        segments.append(segment)
    commits = sorted({s["commit"] for s in segments if s["steps_after"] > s["steps_before"]})
    resolved = _read_yaml(run_dir / "resolved.yaml") or {}
    return {
        "format": RUN_INFO_FORMAT,
        "experiment": str(experiment), "round": round_.name, "arm": arm, "seed": seed,
        "steps": _count_lines(run_dir / "metrics.jsonl"),
        "commit": commits[0] if len(commits) == 1 else None,  # None: no step yet, or several commits
        "commits": commits,
        "dirty": any(s["dirty"] == "true" for s in segments),
        "segments": segments,
        "overrides": overrides,
        "config": _read_yaml(run_dir / "config.yaml"),
        "resolved": {k: v for k, v in resolved.items() if not k.startswith("code.")},
    }


def _segment(run_dir: Path, started: float, steps_before: int, rc: int) -> dict[str, Any]:
    """One start of an arm: its commit as the trainer recorded it (resolved.yaml, rewritten at
    each start), else the launcher's checkout."""
    from megatron_calibclip.trainer.provenance import code_version

    resolved = run_dir / "resolved.yaml"
    fresh = resolved.exists() and resolved.stat().st_mtime >= started
    code, source = ((_read_yaml(resolved) or {}), "trainer") if fresh else (code_version(), "launcher")
    iso = lambda t: dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")  # noqa: E731
    return {"commit": code.get("code.commit", "unknown"), "dirty": code.get("code.dirty", "unknown"),
            "commit_from": source, "started": iso(started), "finished": iso(time.time()),
            "exit_code": rc, "steps_before": steps_before, "steps_after": _count_lines(run_dir / "metrics.jsonl")}


def collect_seeded(run_dir: Path, out_dir: Path, info: dict[str, Any]) -> int:
    """Write run_info.json in the run directory and copy it, metrics.jsonl and samples.jsonl
    to `out_dir`; returns the step count."""
    (run_dir / RUN_INFO).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "samples.jsonl", RUN_INFO):
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, out_dir / name)
    return info["steps"]


def set_aside_unresumable(run_dir: Path, steps: int) -> Optional[Path]:
    """Move an arm's run directory aside when the trainer could not resume it: it holds
    metrics of an unfinished run but no checkpoint (the arm was stopped before its first
    save). The trainer refuses such a directory (trainer/run_dir.py), so without this a
    re-run would fail on that arm every time; the partial run is kept beside it, never
    deleted. Returns where it went (None: nothing to do)."""
    from megatron_calibclip.trainer.run_dir import inspect

    state = inspect(run_dir)
    if state.has_checkpoint or state.metrics_records == 0 or state.metrics_records >= steps:
        return None
    n = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.no-checkpoint-{n}")).exists():
        n += 1
    run_dir.rename(aside)
    return aside


def _arms_of(args: argparse.Namespace, round_: Round) -> list[str]:
    """--arms a,b or --arms a b (default: the round's arms, in its order)."""
    if not args.arms:
        return list(round_.arms)
    arms = [a for text in args.arms for a in text.split(",") if a]
    outside = [a for a in arms if a not in round_.arms]
    if outside:
        raise ConfigError(f"round {round_.name!r} has no arm(s) {outside} (its arms: {', '.join(round_.arms)})")
    return arms


def _run_arm(args, exp: Experiment, round_: Round, arm: str, steps: int, metrics_dir: Path,
             env) -> tuple[int, int, Path]:
    """Run (or resume) one arm of ``steps`` steps and collect its files; returns (exit code,
    steps of metrics, the folder they were copied to)."""
    runs_dir = seed_root(Path(args.runs_dir), args.seed)
    cmd = arm_command(exp, arm, args.nproc, str(runs_dir), round_, args.seed)
    print(f"arm {arm}: {' '.join(cmd)}", flush=True)
    run_dir = runs_dir / arm
    aside = set_aside_unresumable(run_dir, steps)
    if aside is not None:
        print(f"arm {arm}: {run_dir} held {_count_lines(aside / 'metrics.jsonl')} steps of "
              f"metrics but no checkpoint to resume from; moved to {aside}, starting at step 0",
              flush=True)
    started, before = time.time(), _count_lines(run_dir / "metrics.jsonl")
    rc = subprocess.call(cmd, env=env)
    if args.seed is None:
        return rc, collect_metrics(runs_dir, metrics_dir, arm), metrics_dir / arm
    out_dir = seed_root(metrics_dir, args.seed) / arm
    if not run_dir.exists():  # refused before it started
        return rc, 0, out_dir
    info = run_info_record(run_dir, experiment=Path(args.experiment), round_=round_, arm=arm, seed=args.seed,
                           overrides=exp.overrides(arm, round_, args.seed),
                           segment=_segment(run_dir, started, before, rc))
    return rc, collect_seeded(run_dir, out_dir, info), out_dir


def run_reproduce(args: argparse.Namespace) -> int:
    try:
        exp = load_experiment(args.experiment)
        round_ = exp.select_round(args.round, args.seed)
        arms = _arms_of(args, round_)
        steps_of = _check_arms(exp, arms, str(seed_root(Path(args.runs_dir), args.seed)), round_, args.seed)
    except ConfigError as err:
        print(f"calibclip experiment reproduce: {err}", file=sys.stderr)
        return 2
    metrics_dir = Path(args.metrics_dir or Path(args.experiment).parent)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    where = f"round {round_.name}" + ("" if args.seed is None else f", seed {args.seed}")
    failed = []
    for i, arm in enumerate(arms, 1):
        print(f"[{i}/{len(arms)}] {where}", flush=True)
        t = time.perf_counter()
        rc, steps, out_dir = _run_arm(args, exp, round_, arm, steps_of[arm], metrics_dir, env)
        print(f"[{i}/{len(arms)}] arm {arm}: exit {rc} after {time.perf_counter() - t:.0f}s; "
              f"{steps} steps of metrics in {out_dir}", flush=True)
        if rc != 0:
            failed.append(arm)
            if not args.keep_going:
                break
    if failed:
        print(f"calibclip experiment reproduce: arm(s) {', '.join(failed)} failed; run the same "
              f"command again to resume", file=sys.stderr)
        return 1
    print(f"done; `calibclip experiment report --experiment {args.experiment}` draws the figure "
          f"and the table", flush=True)
    return 0
