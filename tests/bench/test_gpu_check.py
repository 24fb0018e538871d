"""tools/gpu_check.py: the CPU rehearsal (--smoke) runs every section within 2 minutes and
writes one JSON whose figures hold; without CUDA the real check refuses in one line."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"
ENV = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "SLURM_NTASKS")}


def test_smoke_runs_every_section_and_passes(tmp_path):
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, str(TOOL), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert time.perf_counter() - t < 120
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    s = doc["sections"]
    assert doc["passed"] is True and doc["env"]["auto_backend"][0] == "emulated"
    assert list(s) == ["a_quantizer", "b_logprobs", "c_batch_invariance", "d_grpo",
                       "e_throughput"]
    assert all(sec["passed"] is True and "thresholds" in sec for sec in s.values())
    gemms = {k: v for k, v in s["a_quantizer"].items() if k.startswith("k")}
    assert len(gemms) == 4 and all(v["codes_equal"] and v["gemm_rel"] <= 1e-4
                                   for v in gemms.values())
    for gran in ("tensorwise", "rowwise"):  # on CPU torch's _scaled_mm equals the emulation
        lp = s["b_logprobs"][gran]
        assert lp["mean_abs_fp8_vs_bf16"] > 0 and lp["ratio"] <= 0.1
    inv = s["c_batch_invariance"]
    assert inv["bf16"]["bitwise_equal"]  # the emulated BF16 GEMM is row-independent on CPU
    assert inv["tensorwise"]["max_abs_mb4_vs_mb2"] > 0  # one activation scale per micro-batch
    for arm in ("bf16", "fp8-calibrated"):
        run = s["d_grpo"][arm]
        assert run["steps"] == 2 and all(math.isfinite(e) for e in run["entropy"])
    ratios = [v["fp8_over_bf16"] for v in s["e_throughput"].values()
              if isinstance(v, dict) and "fp8_over_bf16" in v]
    assert ratios and all(math.isfinite(r) and r > 0 for r in ratios)


def test_without_cuda_the_real_check_refuses(tmp_path):
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()
