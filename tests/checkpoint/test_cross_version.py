"""A trainer checkpoint written under the other supported megatron-core line resumes here and
computes the step after it as the writer did (docs/versions.md, "Checkpoints across lines").

Under 0.16, a 0.19 checkpoint is refused in one line that says why (compat.checkpoint_refusal).
The reference is the writing release's own record of that step (tests/checkpoint/
cross_version.py), not this release's code. Both directions run: the 0.16 leg resumes the
0.19 fixture, the 0.19 leg the 0.16 one; a fixture of the installed release is skipped (the
same-release resume has its own bit-exact tests)."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from megatron_calibclip import compat
from tests.checkpoint import cross_version

pytestmark = pytest.mark.dist

FIXTURES = sorted(p for p in cross_version.DATA.glob("megatron-core-*") if p.is_dir())


def test_a_fixture_for_each_supported_line():
    from megatron_calibclip.patches.sites import SUPPORTED_RELEASES

    assert [p.name.split("-")[-1] for p in FIXTURES] == list(SUPPORTED_RELEASES)


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    return a == b


@pytest.mark.parametrize("fixture", FIXTURES, ids=[p.name for p in FIXTURES])
def test_resume_a_checkpoint_of_another_release(fixture, tmp_path):
    written_by = json.loads((fixture / "written_by.json").read_text())
    if written_by["megatron_core"] == compat.megatron_version():
        pytest.skip(f"written by the installed release {compat.megatron_version()} (the "
                    f"same-release resume is tests/checkpoint/test_trainer_resume.py)")
    shutil.copytree(fixture / "checkpoints", tmp_path / cross_version.RUN / "checkpoints")
    proc = cross_version.train(tmp_path, steps=3)
    if compat.checkpoint_refusal(written_by["megatron_core"]):  # 0.19's format under 0.16
        assert proc.returncode != 0
        errors = [l for l in proc.stderr.splitlines() if l.startswith("calibclip train: ")]
        assert errors and "no common.pt" in errors[0] and "resume it under 0.19.x" in errors[0]
        assert "Traceback" not in proc.stderr.split(errors[0])[0]  # refused before loading
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = cross_version.step_record(tmp_path / cross_version.RUN, 2)
    expected = json.loads((fixture / "next_step.json").read_text())
    assert set(record) == set(expected)
    differ = {k: (record[k], expected[k]) for k in expected if not _close(record[k], expected[k])}
    assert not differ, f"step 2 after resuming a {written_by['megatron_core']} checkpoint: {differ}"
    # it resumed (started at step 2); a fresh start would have written steps 0-2
    steps = [json.loads(l)["step"] for l in
             (tmp_path / cross_version.RUN / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2]
