"""`tools/gpu_check.py --smoke`: every section runs on the CPU (tiny shapes), passes its own
recorded thresholds against its recorded reference, and writes one JSON whose figures are
finite; what a CPU cannot run is listed in "not_run" and nothing else is. The check cannot
pass by mistake: a section that raises makes the tool exit 1, and a case that did not run
fails outside a CPU smoke run (runner verdict, unit-level below)."""
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["a_quantizer", "b_native_vs_emulated", "c_batch_invariance", "f_te_vs_emulation",
            "e_throughput", "d_grpo"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


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
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--smoke",
                           "--device", "cpu", "--out", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    return proc, out


def _report(smoke) -> dict:
    return json.loads((smoke[1] / "gpu_check.json").read_text())


def test_smoke_passes_and_writes_one_json(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in out.iterdir()] == ["gpu_check.json"]
    report = _report(smoke)
    assert report["smoke"] is True and report["passed"] is True and "unfinished" not in report
    assert report["wall_s"] < 120, "the smoke must stay under 2 minutes"
    assert report["machine"]["fp8_backend_auto"]["backend"] == "emulated"
    assert report["not_supported_by_this_gpu"] == []
    assert list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["passed"] is True and "error" not in section, (name, section)
        assert isinstance(section["reference"], str) and section["reference"], name
        assert section["thresholds"], name
        assert section["ran"] is (name != "f_te_vs_emulation"), name
        assert all(math.isfinite(x) for x in _finite_numbers(section)), name
    for name in SECTIONS:
        verdict = "NOT RUN" if name == "f_te_vs_emulation" else "PASS"
        assert f"gpu_check: {name}: {verdict}" in proc.stderr


def test_not_run_names_exactly_the_cpu_limitations(smoke):
    report = _report(smoke)
    got = {(e["section"], e["case"], e["limitation"]) for e in report["not_run"]}
    want = {("f_te_vs_emulation", None, "no_cuda")}
    for k in (4096, 12288):
        want |= {("a_quantizer", f"K{k}/tensorwise/te_reference", "no_transformer_engine"),
                 ("a_quantizer", f"K{k}/blockwise/te_reference", "no_transformer_engine"),
                 ("a_quantizer", f"K{k}/blockwise/gemm", "cpu_no_block_scaled_mm")}
    assert got == want and len(report["not_run"]) == len(want)
    assert all(e["accepted"] and e["why"] for e in report["not_run"])
    f = report["sections"]["f_te_vs_emulation"]
    assert f["why"] == "needs CUDA and transformer-engine"


def test_quantizer_against_independent_references(smoke):
    section = _report(smoke)["sections"]["a_quantizer"]
    limits = section["thresholds"]
    assert set(section["cases"]) == {f"K{k}/{g}" for k in (4096, 12288)
                                     for g in ("tensorwise", "rowwise", "blockwise")}
    for key, case in section["cases"].items():
        assert case["ran"] and case["passed"], key
        assert case["formula"]["independent"] is False
        for role in ("activation", "weight"):
            assert case["formula"][role]["code_mismatch_fraction"] == 0.0, (key, role)
            assert case["formula"][role]["scale_rel_diff"] == 0.0, (key, role)
        if key.endswith("blockwise"):  # CPU torch has no block-scaled GEMM: the reason is kept
            assert case["gemm"]["ran"] is False
            assert "scaling" in case["gemm"]["why"].lower(), case
        else:  # vs the float64 product of the ORIGINAL operands, within e4m3's noise
            gemm = case["gemm"]
            assert gemm["ran"] and 0.02 < gemm["rel_fro_vs_fp64_original"] < 0.08, gemm
            assert limits["gemm_error_over_fp8_noise_min"] <= gemm["error_over_noise"] <= \
                limits["gemm_error_over_fp8_noise_max"]
            assert 0.5 < gemm["error_over_noise"] < 0.9, gemm  # the derivation's ~0.7
        if key.endswith("rowwise"):
            assert case["te_reference"].startswith("none:")
        else:
            assert case["te_reference"]["ran"] is False


def test_native_fp8_invariance_grpo_and_throughput_figures(smoke):
    sections = _report(smoke)["sections"]
    native = sections["b_native_vs_emulated"]
    limits = native["thresholds"]
    assert native["params_dtype"] == "torch.float32"  # the trainer's CPU choice
    for granularity, case in native["cases"].items():
        assert case["ran"] and case["fp8_effect"]["mean"] > 1e-4, granularity
        assert case["ratio"] <= limits["native_vs_emulated_over_fp8_effect_max"]
        for grad in ("dgrad", "wgrad"):
            figures = case["backward"][grad]
            assert figures["fp8_effect_rel_fro"] > 1e-3, (granularity, grad)
            assert figures["ratio"] <= limits["model_grad_native_vs_emulated_over_fp8_effect_max"]
        for name in ("output", "dgrad", "wgrad"):
            assert case["linear"][name]["ratio"] <= \
                limits["linear_native_vs_emulated_over_fp8_effect_max"], (granularity, name)

    invariance = sections["c_batch_invariance"]
    cases = invariance["cases"]
    assert invariance["layer_spec"] == "emulated"
    assert set(cases) == {"bf16", "tensorwise/auto", "blockwise/emulated"}
    assert cases["bf16"]["mb2_vs_mb4"]["max"] <= 1e-2
    assert cases["blockwise/emulated"]["mb2_vs_mb4"]["max"] <= 1e-2
    assert cases["tensorwise/auto"]["mb2_vs_mb4"]["mean"] > 0  # one scale per micro-batch

    grpo = sections["d_grpo"]
    assert (grpo["trainer_backend"], grpo["rollout_engine"]) == ("ours", "megatron")
    for precision in ("bf16", "fp8"):
        run = grpo["runs"][precision]
        assert run["ran"] and run["steps_completed"] == grpo["requested_steps"] == 2
        assert not run["non_finite"] and [s["step"] for s in run["steps"]] == [0, 1]
        assert all("reward_mean" in s and "loss/entropy_mean" in s for s in run["steps"])
        # the rollout/trainer agreement d_grpo now requires, on the CPU's megatron engine
        assert 1.0 <= run["mult_prob_error_max"] <= grpo["thresholds"]["mult_prob_error_max"][precision]
    calibrations = grpo["runs"]["fp8"]["calibrations"]
    assert calibrations["ran"] == calibrations["due"] == [0, 1]
    assert all("clip/lower" in s and "calib/ran" in s for s in grpo["runs"]["fp8"]["steps"])

    throughput = sections["e_throughput"]
    assert throughput["layer_spec"] == "emulated" and throughput["fp8_backend"] == "emulated"
    assert throughput["fp8_over_bf16_tokens_per_s"] > 0
    assert set(throughput["tokens_per_s"]) == {"bf16", "fp8"}
    assert throughput["targets"]["fp8_over_bf16_tokens_per_s_min"] == 1.0
    assert isinstance(throughput["target_met"], bool)


def test_a_section_that_raises_makes_the_tool_exit_1(tmp_path):
    """tools/gpu_check.py main() with one section's run broken: exit 1, the error recorded.
    A subprocess, so that this test's torch.distributed world dies with it."""
    tool_path = str(ROOT / "tools" / "gpu_check.py")
    script = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("gpu_check_tool", {tool_path!r})
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        from megatron_calibclip.bench.gpu_check import quantizer

        def broken(opts):
            raise RuntimeError("deliberately broken section")

        quantizer.run = broken
        sys.exit(tool.main(["--smoke", "--device", "cpu", "--out", {str(tmp_path)!r},
                            "--sections", "a_quantizer", "e_throughput"]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    section = report["sections"]["a_quantizer"]
    assert report["passed"] is False and section["passed"] is False
    assert section["ran"] is False and section["error"]["type"] == "RuntimeError"
    assert section["verdict"].startswith("FAIL")
    assert report["sections"]["e_throughput"]["passed"] is True  # the others still run
    assert {(e["section"], e["accepted"]) for e in report["not_run"]} == {("a_quantizer", False)}
    assert "gpu_check: a_quantizer: FAIL" in proc.stderr


def test_a_section_whose_module_is_missing_records_its_error(monkeypatch):
    from megatron_calibclip.bench.gpu_check import CheckOptions, runner

    monkeypatch.setitem(runner._MODULES, "a_quantizer", "no_such_section_module")
    record = runner.run_section("a_quantizer", CheckOptions.for_run("cpu", smoke=True))
    assert record["passed"] is False and record["ran"] is False
    assert record["error"]["type"] == "ModuleNotFoundError"
    assert "no_such_section_module" in record["error"]["message"]
    assert record["wall_s"] >= 0


def _fabricated(case: dict) -> dict:
    return {"ran": True, "reference": "r", "thresholds": {"x": 1}, "passed": True,
            "cases": {"ok": {"ran": True, "passed": True}, "unrun": case}}


def test_verdict_a_not_run_case_fails_outside_a_cpu_smoke_run():
    from megatron_calibclip.bench.gpu_check.common import (
        NO_CUDA,
        NOT_SUPPORTED_BY_THIS_GPU,
        case_error,
        not_run,
    )
    from megatron_calibclip.bench.gpu_check.verdict import judge_report, judge_section

    def passed(case, **where) -> bool:
        record = _fabricated(case)
        judge_section("s", record, **where)
        return record["passed"]

    cpu_limit = not_run("needs CUDA", NO_CUDA)
    assert passed(cpu_limit, smoke=True, device="cpu")  # the one accepted case
    assert not passed(cpu_limit, smoke=False, device="cpu")  # a full run: nothing excused
    assert not passed(cpu_limit, smoke=True, device="cuda", capability=[9, 0])
    assert not passed(not_run("fp8.backend refuses blockwise"), smoke=True, device="cpu")
    assert not passed(case_error(RuntimeError("boom")), smoke=True, device="cpu")
    assert not passed(not_run("claims a CPU limit", "made_up"), smoke=True, device="cpu")
    hopper = not_run("mxfp8 needs 10.0", NOT_SUPPORTED_BY_THIS_GPU, capability=[9, 0])
    assert passed(hopper, smoke=False, device="cuda", capability=[9, 0])
    assert not passed(hopper, smoke=False, device="cuda", capability=[10, 0])
    assert not passed(hopper, smoke=True, device="cpu")
    assert not passed({"ran": True, "passed": False}, smoke=True, device="cpu")
    silent = {"reference": "r", "thresholds": {"x": 1}, "passed": True}  # no `ran`
    judge_section("s", silent, smoke=True, device="cpu")
    assert silent["passed"] is False

    report = {"machine": {}, "sections": {"s": _fabricated(cpu_limit)}}
    judge_report(report, smoke=False, device="cpu")
    assert report["passed"] is False and report["sections"]["s"]["verdict"].startswith("FAIL")
    assert report["not_run"] == [{"section": "s", "case": "unrun", "why": "needs CUDA",
                                  "limitation": NO_CUDA, "accepted": False}]
    report = {"machine": {}, "sections": {"s": _fabricated(cpu_limit)}}
    assert judge_report(report, smoke=True, device="cpu")["passed"] is True


def test_fp8_noise_bound_separates_fp8_from_unquantized():
    """references.fp8_gemm_noise: an e4m3 GEMM measures ~0.7 of it, the unquantized product
    ~0 (the band of section a), whatever our quantizer does (torch's own cast here)."""
    import torch

    from megatron_calibclip.bench.gpu_check.common import rel_fro
    from megatron_calibclip.bench.gpu_check.references import fp8_gemm_noise

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=gen) * 3
    w = torch.randn(128, 1024, generator=gen) * 0.02

    def e4m3(t):
        scale = 448 / t.abs().max()
        return (t * scale).to(torch.float8_e4m3fn).float() / scale

    want = x.double() @ w.double().t()
    noise = fp8_gemm_noise(x, w, torch.float32)
    assert 0.04 < noise < 0.06  # ~2^-4 sqrt(2/3) without subnormals
    assert 0.5 < rel_fro(e4m3(x) @ e4m3(w).t(), want) / noise < 0.9
    assert rel_fro(x @ w.t(), want) / noise < 1e-3


def test_report_writes_non_finite_numbers_as_strings(tmp_path):
    from megatron_calibclip.bench.gpu_check import write_report

    path = write_report({"x": float("nan"), "y": [float("inf"), 1.5]}, tmp_path)
    assert json.loads(path.read_text()) == {"x": "nan", "y": ["inf", 1.5]}
