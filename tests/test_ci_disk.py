"""CI runs both legs on one machine whose disk may be small. Stop 34's first CI try ran out of
space in the 3.12 leg (SmolLM2's 1.6 GB of checkpoints on top of the 3.11 leg's kept temporary
files, two venvs and pip's cache of the CUDA wheels); its second while installing .venv312
beside the 3.11 leg's unused .venv. These tests hold what keeps the footprint to one venv and
what one test needs at a time, and that a failed CI run's tail says what the disk held."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = '''
def test_passes(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"0" * 1_000_000)

def test_fails(tmp_path):
    (tmp_path / "kept.bin").write_bytes(b"1")
    assert False, "kept for debugging"
'''


def test_a_passed_test_leaves_no_temporary_files_a_failed_one_keeps_them(tmp_path):
    (tmp_path / "test_child.py").write_text(_CHILD)
    base = tmp_path / "base"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pytest.ini"), "--rootdir", str(tmp_path),
         "--basetemp", str(base), "-q", str(tmp_path / "test_child.py")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    left = sorted(p.name for p in base.rglob("*.bin"))
    assert left == ["kept.bin"], left


def test_pip_installs_keep_no_wheel_cache(tmp_path):
    """pip's cache would hold a second copy of every wheel (several GB for the CUDA torch)."""
    for goal in (["venv"], ["venv", "PYTHON=python3.12", "CONSTRAINTS=requirements/constraints-py312.txt",
                            "VLLM_EXTRA="]):
        run = subprocess.run(["make", "-n", *goal, f"VENV={tmp_path / 'v'}"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        installs = [line for line in run.stdout.splitlines() if " install " in line and "pip" in line]
        assert len(installs) >= 3, run.stdout
        assert all("--no-cache-dir" in line for line in installs), installs


_FAKE_MAKE = '''#!/usr/bin/env bash
# records each goal and whether the 3.11 leg's .venv is on disk when it starts
echo "$1 venv=$([ -e .venv ] && echo present || echo absent)" >> calls.log
if [ "$1" = test ]; then mkdir -p .venv && head -c 1000 /dev/zero > .venv/big; fi
exit "${FAKE_MAKE_STATUS:-0}"
'''


def _ci_copy(tmp_path: Path) -> Path:
    """.ci/run in a bare copy of the repository, with SLURM's installer and make faked."""
    root = tmp_path / "repo"
    (root / ".ci").mkdir(parents=True)
    (root / "launch").mkdir()
    (root / ".ci" / "run").write_text((REPO / ".ci" / "run").read_text())
    (root / "launch" / "ci_slurm.sh").write_text("exit 0\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(_FAKE_MAKE)
    (bin_dir / "make").chmod(0o755)
    return root


def _run_ci(root: Path, bin_dir: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(root / ".ci" / "run")], cwd=root, env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_ci_frees_the_first_legs_venv_before_the_second(tmp_path):
    """Stop 34's second CI try ran out of disk installing .venv312 beside the unused 3.7 GB .venv."""
    root = _ci_copy(tmp_path)
    run = _run_ci(root, tmp_path / "bin")
    assert run.returncode == 0, run.stdout + run.stderr
    calls = (root / "calls.log").read_text().splitlines()
    assert calls == ["test venv=absent", "test-py312 venv=absent"], calls
    assert "ci: disk before the 3.12 leg" in run.stdout, run.stdout


def test_a_failed_ci_run_ends_with_the_disk_state_and_its_status(tmp_path):
    """Only the tail of a failed CI run is shown: it must say what the disk held."""
    root = _ci_copy(tmp_path)
    run = _run_ci(root, tmp_path / "bin", FAKE_MAKE_STATUS="2")
    assert run.returncode == 2, run.stdout + run.stderr
    tail = run.stdout.strip().splitlines()[-10:]
    assert any(line.startswith("ci: disk at exit (status 2): ") for line in tail), tail
    assert any(line.startswith("ci: held at exit (status 2): ") for line in tail), tail
    assert (root / "calls.log").read_text().splitlines() == ["test venv=absent"]
