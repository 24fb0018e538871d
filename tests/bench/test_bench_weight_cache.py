"""`calibclip bench weight-cache`: both arms run the same steps, agree bit for bit, and the
JSON carries the phases side by side."""
import json
import os
import subprocess
import sys

import pytest

from megatron_calibclip.bench.weight_cache import compare_arms


def test_bench_runs_both_arms_and_finds_them_identical():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "SLURM_NTASKS")}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_calibclip.cli", "bench", "weight-cache", "--json",
         "--steps", "2", "--set", "algorithm.prompts_per_step=2", "--set", "algorithm.group_size=4",
         "--set", "data.size=16", "--set", "rollout.sampling.max_new_tokens=3",
         "--set", "algorithm.mini_batches=2", "--set", "clipping.calibration.period=1"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bit_identical"] and result["parameters_equal"]
    assert result["metrics_differing"] == []
    assert len(result["per_step_seconds"]["off"]) == len(result["per_step_seconds"]["on"]) == 2
    for arm in ("phases_off", "phases_on"):
        assert set(result[arm]) >= {"rollout", "logprobs", "shadow", "update", "step"}
        assert result[arm]["step"] > 0 and result[arm]["shadow"] > 0  # K = 1: shadow each step
    assert result["speedup"]["step"] == pytest.approx(
        result["phases_off"]["step"] / result["phases_on"]["step"], rel=0.02)


def test_compare_arms_reports_a_difference():
    import torch

    rec = {"step": 0, "loss/total": 1.0, "calib/lower": float("nan"), "time/step": 1.0,
           "time/rollout": 0.5}
    params = [torch.zeros(3)]
    same = compare_arms({"off": ([rec], params), "on": ([dict(rec, **{"time/step": 0.5})],
                                                         [torch.zeros(3)])})
    assert same["bit_identical"] and same["speedup"]["step"] == 2.0  # NaN == NaN, timings free
    other = compare_arms({"off": ([rec], params),
                          "on": ([dict(rec, **{"loss/total": 1.0 + 1e-12})], [-torch.zeros(3)])})
    assert not other["bit_identical"]
    assert other["metrics_differing"] == ["loss/total"]
    assert not other["parameters_equal"]  # -0.0 is another bit pattern
