"""A stand-in for `python -m megatron_calibclip.cli train` that follows the checkpoint contract.

Why: it exercises launch/train.sbatch's preemption path (signal -> save -> exit 75 -> requeue ->
resume from `latest`) in seconds and independently of the real trainer, so a failure of the
launch script is told apart from a failure of the trainer. The contract it mimics:
checkpoints in <output_dir>/<run.name>/checkpoints/ with a `latest` pointer; a restart resumes
from `latest`; SIGTERM/SIGUSR1 -> finish the step, save, exit 75; run.save_every=N.

Usage (what train.sbatch runs, with CALIBCLIP_PYTHON=tests/slurm/contract_python.sh):
    contract_trainer.py -m megatron_calibclip.cli train --config C --set k=v ...
Extra key: stub.step_seconds (default 1.0).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

EXIT_REQUEUE = 75


def main(argv: list[str]) -> int:
    sets = {}
    for i, a in enumerate(argv):
        if a == "--set":
            key, _, value = argv[i + 1].partition("=")
            sets[key] = value
    run_dir = Path(sets.get("run.output_dir", "runs")) / sets.get("run.name", "run")
    steps = int(sets.get("run.steps", "5"))
    save_every = int(sets.get("run.save_every", "0"))
    step_seconds = float(sets.get("stub.step_seconds", "1.0"))
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    got: list[int] = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))

    def save(step: int) -> None:
        if rank == 0:
            (ckpt / f"step_{step:08d}").mkdir(exist_ok=True)
            (ckpt / "latest").write_text(f"step_{step:08d}\n")

    start = 0
    if (ckpt / "latest").exists():
        start = int((ckpt / "latest").read_text().strip().split("_")[1]) + 1
        print(f"rank {rank}: resuming at step {start}", flush=True)
    for step in range(start, steps):
        time.sleep(step_seconds)
        if rank == 0:
            with open(run_dir / "metrics.jsonl", "a") as f:
                attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
                f.write(json.dumps({"step": step, "attempt": attempt}) + "\n")
        if save_every and (step + 1) % save_every == 0:
            save(step)
        if got:
            save(step)
            print(f"rank {rank}: signal {got[0]} after step {step}: saved, exit {EXIT_REQUEUE}",
                  flush=True)
            return EXIT_REQUEUE
    save(steps - 1)
    if rank == 0:
        (run_dir / "done.json").write_text(json.dumps({"steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
