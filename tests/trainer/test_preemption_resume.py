"""`calibclip train` on 2 real processes: SIGUSR1 to one rank -> both save after the same step
and exit 75; a restart resumes from `latest` and finishes; every step is logged once."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megatron_calibclip.checkpoint import EXIT_PREEMPTED

pytestmark = pytest.mark.dist
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out_dir):
    port = str(_free_port())
    args = [sys.executable, "-m", "megatron_calibclip.cli", "train", "--config", "tiny-cpu",
            "--set", f"run.output_dir={out_dir}", "--set", f"run.steps={STEPS}",
            "--set", "run.progress=false", "--set", "run.plot=false",
            "--set", "warmup.steps=5", "--set", "data.size=16",
            "--set", "algorithm.prompts_per_step=4", "--set", "algorithm.group_size=4",
            "--set", "algorithm.mini_batches=1", "--set", "parallel.tp=1"]
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
        env.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"})
        procs.append(subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _steps(metrics):
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line]


def test_preempt_one_rank_then_resume(tmp_path):
    metrics = tmp_path / "tiny-cpu" / "metrics.jsonl"
    procs = _launch(tmp_path)
    deadline = time.monotonic() + 240
    while len(_steps(metrics)) < 2:  # let a couple of steps finish first
        assert time.monotonic() < deadline, "training did not start"
        assert all(p.poll() is None for p in procs), procs[0].stdout.read()
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGUSR1)  # only one rank is told; both must stop together
    outs = [p.communicate(timeout=240)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], outs
    stopped = _steps(metrics)
    assert stopped == list(range(len(stopped))) and len(stopped) < STEPS
    assert "preempted: saved after step" in outs[0]
    latest = (tmp_path / "tiny-cpu" / "checkpoints" / "latest").read_text().strip()
    assert latest, "a checkpoint was committed"

    procs = _launch(tmp_path)  # the requeued job
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert _steps(metrics) == list(range(STEPS)), "every step exactly once, in order"
    assert "supervised warm-up" not in outs[0], "a resumed run must not warm up again"
