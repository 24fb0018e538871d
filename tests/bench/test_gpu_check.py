"""`tools/gpu_check.py --smoke`: every section runs on the CPU (tiny shapes), passes its own
recorded thresholds, and writes one JSON whose figures are finite; a failing section is
recorded with its error instead of stopping the others."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["a_quantizer", "b_native_vs_emulated", "c_batch_invariance", "e_throughput", "d_grpo"]


def _finite_numbers(value):
    """Every number in a nested record (NaN/inf are written as strings "nan"/"inf")."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _finite_numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _finite_numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--smoke",
                           "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, out


def test_smoke_passes_and_writes_one_json(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in out.iterdir()] == ["gpu_check.json"]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["smoke"] is True and report["passed"] is True and "unfinished" not in report
    assert report["wall_s"] < 120, "the smoke must stay under 2 minutes"
    assert report["machine"]["fp8_backend_auto"]["backend"] == "emulated"
    assert list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["passed"] is True and "error" not in section, (name, section)
        assert section["thresholds"], name
        assert all(math.isfinite(x) for x in _finite_numbers(section)), name
    for line in SECTIONS:
        assert f"gpu_check: {line}: PASS" in proc.stderr


def test_quantizer_matches_the_backend_and_records_blockwise_refusal(smoke):
    section = json.loads((smoke[1] / "gpu_check.json").read_text())["sections"]["a_quantizer"]
    limits = section["thresholds"]
    assert set(section["cases"]) == {f"K{k}/{g}" for k in (4096, 12288)
                                     for g in ("tensorwise", "rowwise", "blockwise")}
    for key, case in section["cases"].items():
        for role in ("activation", "weight"):
            assert case[role]["code_mismatch_fraction"] == 0.0, (key, role)
            assert case[role]["scale_rel_diff"] == 0.0, (key, role)
        if key.endswith("blockwise"):  # CPU torch has no block-scaled GEMM: the reason is kept
            assert "scaling" in case["gemm"]["unsupported"]["message"].lower(), case
        else:  # rowwise GEMMs write BF16 (CUDA's rowwise kernel)
            limit = "gemm_rel_fro_bf16_out_max" if key.endswith("rowwise") else \
                "gemm_rel_fro_fp32_out_max"
            assert 0 < case["gemm"]["rel_fro"] <= limits[limit], case


def test_native_fp8_invariance_grpo_and_throughput_figures(smoke):
    sections = json.loads((smoke[1] / "gpu_check.json").read_text())["sections"]
    native = sections["b_native_vs_emulated"]
    for granularity, case in native["cases"].items():
        assert case["fp8_effect"]["mean"] > 1e-4, granularity
        assert case["ratio"] <= native["thresholds"]["native_vs_emulated_over_fp8_effect_max"]

    cases = sections["c_batch_invariance"]["cases"]
    assert cases["bf16"]["mb2_vs_mb4"]["max"] <= 1e-2
    assert cases["blockwise/emulated"]["mb2_vs_mb4"]["max"] <= 1e-2
    assert cases["tensorwise/torch"]["mb2_vs_mb4"]["mean"] > 0  # one scale per micro-batch
    assert "blockwise" in cases["blockwise/torch"]["unsupported"]["message"]

    grpo = sections["d_grpo"]
    for precision in ("bf16", "fp8"):
        run = grpo["runs"][precision]
        assert run["steps_completed"] == grpo["requested_steps"] == 2 and not run["non_finite"]
        assert [s["step"] for s in run["steps"]] == [0, 1]
        assert all("reward_mean" in s and "loss/entropy_mean" in s for s in run["steps"])
    calibrations = grpo["runs"]["fp8"]["calibrations"]
    assert calibrations["ran"] == calibrations["due"] == [0, 1]
    assert all("clip/lower" in s and "calib/ran" in s for s in grpo["runs"]["fp8"]["steps"])

    throughput = sections["e_throughput"]
    assert throughput["fp8_over_bf16_tokens_per_s"] > 0
    assert set(throughput["tokens_per_s"]) == {"bf16", "fp8"}
    assert throughput["targets"]["fp8_over_bf16_tokens_per_s_min"] == 1.0
    assert isinstance(throughput["target_met"], bool)


def test_a_failing_section_records_its_error(monkeypatch):
    from megatron_calibclip.bench.gpu_check import CheckOptions, runner

    monkeypatch.setitem(runner._MODULES, "a_quantizer", "no_such_section_module")
    record = runner.run_section("a_quantizer", CheckOptions.for_run("cpu", smoke=True))
    assert record["passed"] is False
    assert record["error"]["type"] == "ModuleNotFoundError"
    assert "no_such_section_module" in record["error"]["message"]
    assert record["wall_s"] >= 0


def test_report_writes_non_finite_numbers_as_strings(tmp_path):
    from megatron_calibclip.bench.gpu_check import write_report

    path = write_report({"x": float("nan"), "y": [float("inf"), 1.5]}, tmp_path)
    assert json.loads(path.read_text()) == {"x": "nan", "y": ["inf", 1.5]}
