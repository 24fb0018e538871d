"""Checkpoints written under one megatron-core line, resumed under the other (docs/versions.md).

A fixture is a real trainer checkpoint of a tiny TP=2 run (policy, megatron Adam state, the
frozen reference, the calibrated clipper, data cursor, RNG), written by the trainer under one
release, plus the record of the step that the writing release computed right after it:

    data/cross-version/megatron-core-<release>/
        checkpoints/              the trainer's checkpoint folder after 2 steps (step 2 latest)
        next_step.json            step index 2 as the writer computed it after resuming
        written_by.json           megatron-core, torch, Python of the writer

Write one (under the release to record; each CI leg reads the other's):

    python -m tests.checkpoint.cross_version write   # -> data/cross-version/megatron-core-<v>/

The test (test_cross_version.py) copies a fixture into a new run folder, resumes it under the
installed release and compares step 2 with the writer's record.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).with_name("data") / "cross-version"
RUN = "xv"

# the bundled tiny-cpu config (TP=2), shrunk so that a fixture is small and a step is quick
OVERRIDES = [
    "run.name=" + RUN, "run.tensorboard=false", "run.plot=false", "run.progress=false",
    "warmup.steps=2", "algorithm.prompts_per_step=8", "algorithm.mini_batches=2",
    "algorithm.micro_batch_size=8", "algorithm.logprob_micro_batch_size=16",
    "clipping.calibration.period=2",
    # the GEMM path the fixtures were written with (the default then); "auto" would take
    # fp32 GEMMs on a CPU without native BF16 ones, whose step differs by ~2e-4 with torch's
    # CUDA wheel (measured on the Python 3.12 leg)
    "run.gemm_path=native",
]


def train(output_dir: Path, steps: int) -> subprocess.CompletedProcess:
    """One `calibclip train` (2 ranks, TP=2) in output_dir/xv; resumes from its checkpoints."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "megatron_calibclip.cli",
           "train", "--config", "tiny-cpu"]
    for text in OVERRIDES + [f"run.output_dir={output_dir}", f"run.steps={steps}"]:
        cmd += ["--set", text]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def step_record(run_dir: Path, step: int) -> dict:
    """The metrics of one step, without timings."""
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("step") == step:
            return {k: v for k, v in record.items() if not k.startswith("time/")}
    raise LookupError(f"no step {step} in {run_dir / 'metrics.jsonl'}")


def write(out_root: Path = DATA) -> Path:
    import torch

    work = Path(out_root) / ".work"
    shutil.rmtree(work, ignore_errors=True)
    for steps in (2, 3):  # checkpoint after 2 steps, then the writer's own resume to 3
        proc = train(work, steps)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        if steps == 2:
            snapshot = work / "snapshot"
            shutil.copytree(work / RUN / "checkpoints", snapshot)
    from megatron_calibclip.compat import megatron_version

    out = Path(out_root) / f"megatron-core-{megatron_version()}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copytree(snapshot, out / "checkpoints")
    (out / "next_step.json").write_text(json.dumps(step_record(work / RUN, 2), indent=1) + "\n")
    (out / "written_by.json").write_text(json.dumps({
        "megatron_core": megatron_version(), "torch": torch.__version__,
        "python": platform.python_version()}, indent=1) + "\n")
    shutil.rmtree(work)
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["write"]:
        raise SystemExit("usage: python -m tests.checkpoint.cross_version write")
    print(write())
