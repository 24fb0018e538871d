"""A real one-node SLURM cluster for the tests in this folder (launch/ci_slurm.sh).

Why a session fixture: starting the daemons costs ~3 s and every test here needs them. The
cluster lives in its own temp folder with its own ports, so it never meets a system SLURM or
another checkout's cluster, and it is always stopped by the pid files `start` wrote, even
when a test fails. Without SLURM (not installed, not root, daemons that do not come up) every
test here is skipped with the reason, except under CI (`CI=true`, as CI services set it),
where a cluster that cannot start fails these tests: CI must not stay green without them.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CI_SLURM = REPO / "launch" / "ci_slurm.sh"


@dataclass
class Cluster:
    state_dir: Path  # slurm.conf, logs, pid files
    env: dict  # os.environ + SLURM_CONF: pass to sbatch/scontrol/scancel

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        out = subprocess.run(list(args), env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        if check and out.returncode:
            raise AssertionError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return out.stdout

    def job(self, job_id: str) -> dict:
        """`scontrol show job -o` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", "-o", job_id)
        fields = {}
        for token in text.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.state_dir / "log" / name
            if path.exists():
                tail = "\n".join(path.read_text().splitlines()[-15:])
                parts.append(f"--- {name} (tail)\n{tail}")
        return "\n".join(parts)


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65000:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    return 6817


def _pids(state_dir: Path) -> dict[str, int]:
    files = {"slurmctld": state_dir / "run" / "slurmctld.pid",
             "slurmd": state_dir / "run" / "slurmd.pid",
             "munged": state_dir / "munge" / "munged.pid"}
    return {name: int(f.read_text()) for name, f in files.items()
            if f.exists() and f.read_text().strip()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unavailable(reason: str) -> None:
    """Skip, or under CI (CI=true) fail: a missing cluster must not pass CI unnoticed."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true but the local SLURM cluster is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster():
    missing = [t for t in ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
               if shutil.which(t) is None]
    if missing:
        _unavailable(f"SLURM is not installed ({', '.join(missing)} not found); "
                     f"run `bash launch/ci_slurm.sh install` as root")
    if os.geteuid() != 0:
        _unavailable("the local SLURM cluster runs its daemons as root (SlurmUser=root)")
    state_dir = Path(tempfile.mkdtemp(prefix="calibclip-slurm-", dir="/tmp"))
    env = dict(os.environ, CALIBCLIP_SLURM_DIR=str(state_dir),
               CALIBCLIP_SLURM_PORT=str(_free_port_pair()))
    t0 = time.monotonic()

    def _interrupt(signum, frame):  # a SIGTERM'd test run still stops the daemons below
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _interrupt)
    start = subprocess.run(["bash", str(CI_SLURM), "start"], env=env, capture_output=True,
                           text=True, timeout=120)
    pids = _pids(state_dir)
    try:
        if start.returncode:
            reason = next((line[5:].strip() for line in start.stderr.splitlines()
                           if line.startswith("SKIP:")), None)
            reason = reason or ("the local SLURM cluster did not start: "
                                f"{start.stderr.strip()[-500:]}")
            _unavailable(reason)
        env["SLURM_CONF"] = str(state_dir / "slurm.conf")
        print(f"\nlocal SLURM cluster up in {time.monotonic() - t0:.1f}s at {state_dir} "
              f"(pids {pids})")
        yield Cluster(state_dir, env)
    finally:
        pids = _pids(state_dir) or pids
        subprocess.run(["bash", str(CI_SLURM), "stop"], env=env, capture_output=True, text=True,
                       timeout=120)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {n: p for n, p in pids.items() if _alive(p)}
        for pid in left.values():  # last resort, still by pid
            os.kill(pid, 9)
        shutil.rmtree(state_dir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
        assert not left, f"daemons survived `ci_slurm.sh stop`: {left}"
