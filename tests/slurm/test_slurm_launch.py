"""launch/train.sbatch on a real one-node SLURM cluster, in CPU mode (2 ranks, tiny config).

What is checked, and against what:
- launch script + real trainer: `sbatch --wait` succeeds and the run writes its metrics
  (works today);
- launch script + real trainer + checkpoint contract: the same job leaves a checkpoint
  with a `latest` pointer, and a job preempted mid-run (SIGUSR1, what `--signal` sends) is
  requeued and resumes from its checkpoint to finish. These two wait for the trainer side of
  the contract (checkpoints in <run>/checkpoints/ with `latest`; resume from `latest`;
  SIGUSR1/SIGTERM -> save -> exit 75) and fail, naming what is missing, until it lands;
- launch script mechanics alone, with tests/slurm/contract_trainer.py standing in for the
  trainer: signal -> exit 75 -> requeue -> resume -> done (works today).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "launch" / "train.sbatch"
CONTRACT_PYTHON = Path(__file__).with_name("contract_python.sh")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
# the tiny config: short warm-up, small steps, no progress bars/plots that cost time on 2 cores
TINY = ["--set", "warmup.steps=5", "--set", "run.plot=false", "--set", "run.tensorboard=false",
        "--set", "algorithm.prompts_per_step=8", "--set", "algorithm.mini_batches=2"]


def _submit(cluster, tmp_path: Path, name: str, overrides: list[str], *, wait: bool,
            python: str = sys.executable, extra_env: dict | None = None):
    env = dict(cluster.env, CALIBCLIP_CPU="1", CALIBCLIP_PYTHON=python,
               CALIBCLIP_OUTPUT_DIR=str(tmp_path / "runs"), OMP_NUM_THREADS="1",
               CONTRACT_PYTHON=sys.executable, **(extra_env or {}))
    cmd = ["sbatch", "--parsable", "-N1", "--ntasks-per-node=2", f"--job-name={name}",
           f"--output={tmp_path}/%x-%j.out", f"--chdir={REPO}", "--time=10"]
    if wait:
        cmd.append("--wait")
    cmd += [str(SBATCH_SCRIPT), "tiny-cpu", *overrides]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _wait_final(cluster, job_id: str, timeout: float, tmp_path: Path, name: str) -> dict:
    """Poll until the job ends; past `timeout`, cancel it and fail with the job's own log.

    Every caller's waits add up to less than its pytest timeout, so a slow or stuck job fails
    here, with the log that says where it was, instead of in pytest-timeout's thread dump."""
    deadline = time.monotonic() + timeout
    info = cluster.job(job_id)
    while info.get("JobState") not in FINAL_STATES and time.monotonic() < deadline:
        time.sleep(0.5)
        info = cluster.job(job_id)
    if info.get("JobState") not in FINAL_STATES:
        cluster.run("scancel", job_id, check=False)
        raise AssertionError(
            f"job {job_id} still {info.get('JobState')} ({info.get('Reason')}, "
            f"{info.get('Restarts')} restart(s)) after {timeout:.0f}s; attempts "
            f"{_attempts(tmp_path / 'runs' / name)}\n"
            f"--- job log\n{_job_log(tmp_path, name, job_id)[-6000:]}\n{cluster.logs()}")
    return info


def _attempts(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "attempts.tsv"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    header = lines[0].split("\t")
    return [dict(zip(header, line.split("\t"))) for line in lines[1:]]


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _job_log(tmp_path: Path, name: str, job_id: str) -> str:
    path = tmp_path / f"{name}-{job_id}.out"
    return path.read_text() if path.exists() else f"(no job log at {path})"


# --- a plain job: works with the launch script alone -------------------------------------------

@pytest.fixture(scope="module")
def basic_job(slurm_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slurm-basic")
    t0 = time.monotonic()
    try:
        out = _submit(slurm_cluster, tmp, "ci-basic",
                      ["--set", "run.steps=3", "--set", "run.save_every=2", *TINY], wait=True)
    except subprocess.TimeoutExpired:
        slurm_cluster.run("scancel", "--name=ci-basic", check=False)
        logs = "\n".join(p.read_text()[-6000:] for p in tmp.glob("ci-basic-*.out"))
        pytest.fail(f"sbatch --wait did not return within 300 s\n{logs}\n{slurm_cluster.logs()}")
    job_id = out.stdout.strip().split(";")[0]
    info = slurm_cluster.job(job_id) if job_id else {}
    print(f"\nsbatch --wait returned {out.returncode} after {time.monotonic() - t0:.1f}s "
          f"(job {job_id}, {info.get('JobState')})")
    return {"proc": out, "job": job_id, "info": info, "run_dir": tmp / "runs" / "ci-basic",
            "log": _job_log(tmp, "ci-basic", job_id)}


def test_sbatch_job_succeeds_and_writes_metrics(basic_job):
    out, run_dir = basic_job["proc"], basic_job["run_dir"]
    assert out.returncode == 0, f"sbatch --wait failed: {out.stderr}\n{basic_job['log']}"
    assert basic_job["info"].get("JobState") == "COMPLETED", basic_job["log"]
    assert _steps(run_dir) == [0, 1, 2], basic_job["log"]
    assert (run_dir / "done.json").exists()
    attempts = _attempts(run_dir)
    assert [(a["exit"], a["action"]) for a in attempts] == [("0", "done")], attempts
    assert "CPU mode" in basic_job["log"] and "2 tasks" in basic_job["log"]


def test_sbatch_job_writes_a_checkpoint(basic_job):
    """Checkpoint contract: <run>/checkpoints/latest names a checkpoint folder."""
    ckpt = basic_job["run_dir"] / "checkpoints"
    assert basic_job["proc"].returncode == 0, basic_job["log"]
    assert (ckpt / "latest").is_file(), (
        f"no {ckpt}/latest after a finished job: the trainer does not save checkpoints yet "
        f"(checkpoint contract)\n{basic_job['log']}")
    target = ckpt / (ckpt / "latest").read_text().strip()
    assert target.is_dir(), f"latest points at {target}, which does not exist"


# --- preemption: signal -> save -> exit 75 -> requeue -> resume --------------------------------

def _preempt_and_finish(cluster, tmp_path: Path, name: str, overrides: list[str], steps: int,
                        python: str, first_ckpt_timeout: float, finish_timeout: float):
    out = _submit(cluster, tmp_path, name, overrides, wait=False, python=python)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / name
    latest = run_dir / "checkpoints" / "latest"
    t0 = time.monotonic()
    deadline = t0 + first_ckpt_timeout
    state = ""
    while not latest.exists() and time.monotonic() < deadline:
        state = cluster.job(job_id).get("JobState", "")
        if state in FINAL_STATES:
            break
        time.sleep(0.2)
    if not latest.exists():
        cluster.run("scancel", job_id, check=False)
        raise AssertionError(
            f"no checkpoint appeared at {latest} (job {state or 'still running'} after "
            f"{time.monotonic() - t0:.0f}s): the trainer must honour run.save_every "
            f"(checkpoint contract)\n{_job_log(tmp_path, name, job_id)}")
    t_signal = time.monotonic() - t0
    cluster.run("scancel", "--signal=USR1", job_id)  # what `#SBATCH --signal=USR1@300` sends
    info = _wait_final(cluster, job_id, finish_timeout, tmp_path, name)
    log = _job_log(tmp_path, name, job_id)
    print(f"\n{name}: first checkpoint after {t_signal:.1f}s, SIGUSR1 sent, job {info['JobState']} "
          f"after {time.monotonic() - t0:.1f}s with {info.get('Restarts')} restart(s)")
    return info, run_dir, log


@pytest.mark.timeout(600)
def test_requeue_mechanics_with_a_contract_stub(slurm_cluster, tmp_path):
    """train.sbatch alone: exit 75 -> scontrol requeue -> same job resumes -> done."""
    steps = 8
    info, run_dir, log = _preempt_and_finish(
        slurm_cluster, tmp_path, "ci-stub",
        ["--set", f"run.steps={steps}", "--set", "run.save_every=1",
         "--set", "stub.step_seconds=0.5"], steps,
        python=str(CONTRACT_PYTHON), first_ckpt_timeout=200, finish_timeout=300)
    attempts = _attempts(run_dir)
    assert [(a["exit"], a["action"]) for a in attempts] == [("75", "requeued"), ("0", "done")], log
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", (info, log)
    assert _steps(run_dir) == list(range(steps)), log
    assert "resumes from" in log and "resuming at step" in log, log


@pytest.mark.timeout(900)
def test_preempted_job_resumes_from_its_checkpoint_and_finishes(slurm_cluster, tmp_path):
    """The real trainer under the checkpoint contract (fails until the trainer side lands)."""
    steps = 12
    info, run_dir, log = _preempt_and_finish(
        slurm_cluster, tmp_path, "ci-preempt",
        ["--set", f"run.steps={steps}", "--set", "run.save_every=3", *TINY], steps,
        python=sys.executable, first_ckpt_timeout=300, finish_timeout=480)
    attempts = _attempts(run_dir)
    assert attempts and attempts[0]["exit"] == "75", (
        f"the preempted attempt should exit 75 after saving (got {attempts}): the trainer must "
        f"turn SIGUSR1 into save-and-exit-75 (checkpoint contract)\n{log}")
    assert [(a["exit"], a["action"]) for a in attempts] == [("75", "requeued"), ("0", "done")], log
    assert info["JobState"] == "COMPLETED" and int(info.get("Restarts", 0)) == 1, (info, log)
    assert "resumes from" in log, log
    # the second attempt ran only the remaining steps, and the run has every step once
    ran = [int(n) for n in re.findall(r"(\d+) steps in [\d.]+s", log)]
    assert ran and ran[-1] < steps, f"the resumed attempt re-ran from step 0: {ran}\n{log}"
    assert _steps(run_dir) == list(range(steps)), log
    assert (run_dir / "done.json").exists()
    ckpt = run_dir / "checkpoints"
    assert (ckpt / (ckpt / "latest").read_text().strip()).is_dir()
