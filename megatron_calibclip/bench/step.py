"""`calibclip bench step`: seconds per phase of an RL step, and the cost of calibration.

Measured in one run on one set of components: a window of steps with K = 1 (every step
calibrates: BF16 shadow passes + histograms) and a window of 20 steps with K = 20 (one
calibration). The overhead of calibration is (shadow + calibration seconds) / (step
seconds) over each window; the SPEC's default K = 20 targets <= 0.05.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PHASES = ("rollout", "reward", "logprobs", "shadow", "update", "calibration")


def add_step_parser(sub) -> None:
    p = sub.add_parser("step", help="seconds per phase of an RL step and calibration overhead")
    p.add_argument("--config", default="tiny-cpu", help="YAML file or bundled config name")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override")
    p.add_argument("--k1-steps", type=int, default=4, help="measured steps with K = 1")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run_step)


def _window(c, clipper_period: int, steps: int, start: int) -> list[dict]:
    from megatron_calibclip.calibration import CalibratedClipper
    from megatron_calibclip.trainer.step import train_step

    cfg = c.cfg
    calib = cfg.clipping.calibration.__class__(**{**cfg.clipping.calibration.__dict__,
                                                  "period": clipper_period})
    c.clipper = CalibratedClipper(calib, eps_low=cfg.loss.eps_low, eps_high=cfg.loss.eps_high)
    records = []
    for i in range(steps):
        t = time.perf_counter()
        m = train_step(c, i)  # step index i: K | i decides calibration
        m["time/step"] = time.perf_counter() - t
        records.append(m)
    return records


def _overhead(records: list[dict]) -> float:
    cal = sum(r.get("time/shadow", 0.0) + r.get("time/calibration", 0.0) for r in records)
    return cal / sum(r["time/step"] for r in records)


def run_step(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_calibclip.bench.config import load_bench_config
    from megatron_calibclip.parallel import initialize_distributed, teardown
    from megatron_calibclip.trainer.components import build_components

    cfg = load_bench_config(args, "step", ["clipping.mode=calibrated"])
    if cfg is None:
        return 2
    t0 = time.perf_counter()
    initialize_distributed(cfg.parallel.layout(), seed=cfg.run.seed)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            c = build_components(cfg, Path(tmp))
            _window(c, 1, 1, 0)  # warm-up step (first-call costs), not measured
            k1 = _window(c, 1, args.k1_steps, 0)
            k20 = _window(c, 20, 20, 0)
        phases = {p: statistics.fmean(r.get(f"time/{p}", 0.0) for r in k20) for p in PHASES}
        phases["step"] = statistics.fmean(r["time/step"] for r in k20)
        k1_phases = {p: statistics.fmean(r.get(f"time/{p}", 0.0) for r in k1) for p in PHASES}
        k1_phases["step"] = statistics.fmean(r["time/step"] for r in k1)
        result = {
            "benchmark": "step",
            "config": args.config,
            "world_size": dist.get_world_size(),
            "tp": cfg.parallel.tp, "pp": cfg.parallel.pp,
            "sequences_per_step": cfg.algorithm.prompts_per_step * cfg.algorithm.group_size,
            "precision": cfg.precision, "fp8": cfg.fp8.granularity,
            "phases": {k: round(v, 5) for k, v in phases.items()},
            "phases_k1": {k: round(v, 5) for k, v in k1_phases.items()},
            "calibration_overhead": {"1": round(_overhead(k1), 4), "20": round(_overhead(k20), 4)},
            "steps_measured": {"1": len(k1), "20": len(k20)},
            "target_k20_max": 0.05,
            "target_met": _overhead(k20) <= 0.05,
            "wall_seconds": round(time.perf_counter() - t0, 2),
        }
        if dist.get_rank() == 0:
            print(json.dumps(result, indent=None if args.json else 2))
    finally:
        teardown()
    return 0
