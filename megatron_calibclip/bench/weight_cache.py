"""`calibclip bench weight-cache`: RL step phases with and without the weight-operand cache.

Why one run: the same steps from the same weights and seeds, first re-quantizing every
weight at every forward (policy "off", the reference), then with the cache (fp8/
weight_cache.py), on the same machine in the same process, so the ratio is a measurement and
not a comparison of two runs. The two arms must agree bit for bit: every logged metric
(timings aside) and every parameter after the last step; the JSON says whether they do.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from megatron_calibclip.bench.arms import phase_means, run_arm, speedups

ARMS = ("off", "on")


def add_weight_cache_parser(sub) -> None:
    p = sub.add_parser("weight-cache", help="step phases with the weight cache off vs on, "
                                            "and whether the results are bit-identical")
    p.add_argument("--config", default="tiny-cpu", help="YAML file or bundled config name")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override")
    p.add_argument("--steps", type=int, default=2, help="RL steps per arm (>= 1)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.set_defaults(func=run_weight_cache)


def _values(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("time/")}


def _same(a, b) -> bool:
    """Equal, counting NaN == NaN (a metric that is NaN in both arms agrees)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def compare_arms(results: dict[str, tuple[list[dict], list]]) -> dict:
    """Side-by-side phases, speed-up per phase and the bit-identity verdict."""
    import torch
    import torch.distributed as dist

    (off_rec, off_par), (on_rec, on_par) = results["off"], results["on"]
    pairs = [(_values(a), _values(b)) for a, b in zip(off_rec, on_rec)]
    differing = sorted({k for va, vb in pairs for k in va.keys() | vb.keys()
                        if not _same(va.get(k), vb.get(k))})
    params_equal = len(off_par) == len(on_par) and all(
        a.shape == b.shape and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        for a, b in zip(off_par, on_par))  # bit patterns: -0.0 and NaNs count too
    from megatron_calibclip.parallel.devices import collective_device

    flag = torch.tensor([1.0 if params_equal else 0.0], device=collective_device())
    if dist.is_initialized():  # every rank's shard
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    params_equal = bool(flag.item() == 1.0)
    off, on = phase_means(off_rec), phase_means(on_rec)
    speedup = speedups(off, on)
    return {"phases_off": off, "phases_on": on, "speedup": speedup,
            "per_step_seconds": {"off": [round(r["time/step"], 2) for r in off_rec],
                                 "on": [round(r["time/step"], 2) for r in on_rec]},
            "bit_identical": not differing and params_equal,
            "metrics_differing": differing, "parameters_equal": params_equal}


def run_weight_cache(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_calibclip.bench.config import load_bench_config
    from megatron_calibclip.fp8.weight_cache import set_weight_cache_policy
    from megatron_calibclip.parallel import initialize_distributed, teardown

    if args.steps < 1:
        print("calibclip bench weight-cache: --steps must be >= 1", file=sys.stderr)
        return 2
    cfg = load_bench_config(args, "weight-cache")
    if cfg is None:
        return 2
    t0 = time.perf_counter()
    initialize_distributed(cfg.parallel.layout(), seed=cfg.run.seed)
    try:
        results = {}
        for arm in ARMS:
            set_weight_cache_policy(arm)
            results[arm] = run_arm(cfg, args.steps)
        set_weight_cache_policy(None)
        a = cfg.algorithm
        result = {"benchmark": "weight-cache", "config": args.config,
                  "overrides": list(args.set or []), "world_size": dist.get_world_size(),
                  "tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "steps": args.steps,
                  "sequences_per_step": a.prompts_per_step * a.group_size,
                  "mini_batches": a.mini_batches, "precision": cfg.precision,
                  "fp8": cfg.fp8.granularity, **compare_arms(results),
                  "wall_seconds": round(time.perf_counter() - t0, 1)}
        if dist.get_rank() == 0:
            print(json.dumps(result, indent=None if args.json else 2))
    finally:
        set_weight_cache_policy(None)
        teardown()
    return 0 if result["bit_identical"] else 1
