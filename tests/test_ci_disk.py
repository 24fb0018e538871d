"""CI runs both legs on one machine whose disk may be small: stop 34's CI ran out of space in the
3.12 leg (SmolLM2's 1.6 GB of checkpoints on top of the 3.11 leg's kept temporary files, two
venvs and pip's cache of the CUDA wheels). These tests hold the two settings that keep the
suite's footprint to what one test needs at a time."""
from __future__ import annotations

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
