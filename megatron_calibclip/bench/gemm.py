"""`calibclip bench gemm`: RL step phases on the fp32 emulation vs the native BF16 kernels.

Why alternating arms: the two GEMM paths (fp8/gemm.py) run the same steps from the same
weights and seeds in one process, "fp32" then "native", repeated `--repeats` times, so a
machine whose load drifts during the run biases neither side; the JSON gives each phase's
mean per path and their ratio, in wall seconds and in this process's CPU seconds (which
other processes on a shared machine do not inflate). The paths are not bit-identical (the native one sums in
another order and applies FP8 scales after the sum), so sampled tokens may diverge after a
few steps; the metrics keep the same meaning and the JSON lists both paths' rewards and
mismatch figures side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from megatron_calibclip.bench.arms import phase_means, run_arm, speedups

PATHS = ("fp32", "native")
SIDE_BY_SIDE = ("reward_mean", "loss/entropy_mean", "loss/mult_prob_error",
                "loss/clipfrac_lower", "loss/phantom_clipfrac")


def add_gemm_parser(sub) -> None:
    p = sub.add_parser("gemm", help="step phases on the fp32 emulation vs native BF16 GEMMs")
    p.add_argument("--config", default="tiny-cpu", help="YAML file or bundled config name")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override")
    p.add_argument("--steps", type=int, default=2, help="RL steps per arm (>= 1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="how many times the two arms alternate (>= 1)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run_gemm)


def summarize(records: dict[str, list[dict]]) -> dict:
    """Per-path phase means, the fp32 / native ratios, and a few metrics side by side."""
    phases = {path: phase_means(records[path]) for path in PATHS}
    cpu = {path: phase_means(records[path], "time/cpu") for path in PATHS}
    metrics = {path: {k: [round(r[k], 4) for r in records[path] if k in r]
                      for k in SIDE_BY_SIDE} for path in PATHS}
    keys = {path: sorted(k for r in records[path] for k in r if "time/" not in k)
            for path in PATHS}
    return {"phases": phases, "speedup": speedups(phases["fp32"], phases["native"]),
            "cpu_phases": cpu, "cpu_speedup": speedups(cpu["fp32"], cpu["native"]),
            "per_step_seconds": {p: [round(r["time/step"], 2) for r in records[p]]
                                 for p in PATHS},
            "metrics": metrics, "same_metric_keys": keys["fp32"] == keys["native"]}


def run_gemm(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_calibclip.bench.config import load_bench_config
    from megatron_calibclip.fp8.gemm import using_gemm_path
    from megatron_calibclip.parallel import initialize_distributed, teardown

    if args.steps < 1 or args.repeats < 1:
        print("calibclip bench gemm: --steps and --repeats must be >= 1", file=sys.stderr)
        return 2
    cfg = load_bench_config(args, "gemm")
    if cfg is None:
        return 2
    t0 = time.perf_counter()
    initialize_distributed(cfg.parallel.layout(), seed=cfg.run.seed)
    try:
        records: dict[str, list[dict]] = {p: [] for p in PATHS}
        for _ in range(args.repeats):
            for path in PATHS:
                with using_gemm_path(path):
                    records[path] += run_arm(cfg, args.steps)[0]
        a = cfg.algorithm
        result = {"benchmark": "gemm", "config": args.config,
                  "overrides": list(args.set or []), "world_size": dist.get_world_size(),
                  "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "steps": args.steps,
                  "repeats": args.repeats,
                  "sequences_per_step": a.prompts_per_step * a.group_size,
                  "precision": cfg.precision, "rollout_precision": cfg.rollout.precision,
                  "fp8": cfg.fp8.granularity, **summarize(records),
                  "wall_seconds": round(time.perf_counter() - t0, 1)}
        if dist.get_rank() == 0:
            print(json.dumps(result, indent=None if args.json else 2))
    finally:
        teardown()
    return 0
