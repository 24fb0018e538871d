"""`calibclip experiment reproduce`: run the arms of an experiment file, one after another.

Each arm is an ordinary `calibclip train` run under torchrun (run.name = the arm), so it is
resumable: run the command again and every arm continues from its newest checkpoint; a
finished arm is skipped by the trainer ("N steps already done"). After each arm (also when
it stopped early) its metrics.jsonl is copied to `<metrics-dir>/<arm>/metrics.jsonl`, the
small file that is committed and from which `calibclip experiment report` draws.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron_calibclip.config import ConfigError
from megatron_calibclip.experiment.arms import Experiment, load_experiment


def _check_arms(exp: Experiment, arms: list[str], runs_dir: str) -> None:
    """Every arm's configuration loads (mistakes surface before hours of compute)."""
    from megatron_calibclip.trainer.config import load_train_config

    for arm in arms:
        try:
            load_train_config(exp.base, exp.overrides(arm) + [f"run.output_dir={runs_dir}"])
        except ConfigError as err:
            raise ConfigError(f"arm {arm}: {err}") from None


def arm_command(exp: Experiment, arm: str, nproc: int, runs_dir: str) -> list[str]:
    """The torchrun command line of one arm."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "megatron_calibclip.cli", "train",
           "--config", exp.base]
    for text in exp.overrides(arm) + [f"run.output_dir={runs_dir}"]:
        cmd += ["--set", text]
    return cmd


def collect_metrics(runs_dir: Path, metrics_dir: Path, arm: str) -> int:
    """Copy an arm's metrics.jsonl next to the experiment; returns its step count."""
    src = runs_dir / arm / "metrics.jsonl"
    if not src.exists():
        return 0
    dst = metrics_dir / arm / "metrics.jsonl"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return sum(1 for line in dst.read_text().splitlines() if line.strip())


def run_reproduce(args: argparse.Namespace) -> int:
    try:
        exp = load_experiment(args.experiment)
        arms = args.arms or list(exp.arms)
        for arm in arms:
            exp.overrides(arm)  # unknown arm -> ConfigError
        _check_arms(exp, arms, args.runs_dir)
    except ConfigError as err:
        print(f"calibclip experiment reproduce: {err}", file=sys.stderr)
        return 2
    metrics_dir = Path(args.metrics_dir or Path(args.experiment).parent)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    failed = []
    for i, arm in enumerate(arms, 1):
        cmd = arm_command(exp, arm, args.nproc, args.runs_dir)
        print(f"[{i}/{len(arms)}] arm {arm}: {' '.join(cmd)}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        steps = collect_metrics(Path(args.runs_dir), metrics_dir, arm)
        print(f"[{i}/{len(arms)}] arm {arm}: exit {rc} after {time.perf_counter() - t:.0f}s; "
              f"{steps} steps of metrics in {metrics_dir / arm / 'metrics.jsonl'}", flush=True)
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
