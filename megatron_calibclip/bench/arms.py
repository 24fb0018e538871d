"""One benchmark arm: RL steps from freshly built components, with their per-phase seconds.

Shared by `bench weight-cache` and `bench gemm`, which run the same steps from the same
weights and seeds under two settings in one process, so that their ratio is a measurement
and not a comparison of two runs.
"""
from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

PHASES = ("rollout", "reward", "logprobs", "shadow", "update", "calibration")


def run_arm(cfg, steps: int) -> tuple[list[dict], list]:
    """Run `steps` RL steps from freshly built components; (metrics per step, parameters)."""
    from megatron_calibclip.trainer.components import build_components
    from megatron_calibclip.trainer.step import train_step

    with tempfile.TemporaryDirectory() as tmp:
        c = build_components(cfg, Path(tmp))
        records = []
        for i in range(steps):
            t, cpu = time.perf_counter(), time.process_time()
            m = train_step(c, i)
            m["time/step"] = time.perf_counter() - t
            m["time/cpu/step"] = time.process_time() - cpu
            records.append(m)
        params = [p.detach().clone() for p in c.policy.parameters()]
        del c
        gc.collect()
    return records, params


def phase_means(records: list[dict], clock: str = "time") -> dict[str, float]:
    """Mean seconds per phase and per step over `records`: wall ("time") or this process's
    CPU seconds ("time/cpu", not inflated by other processes on a shared machine)."""
    out = {p: statistics.fmean(r.get(f"{clock}/{p}", 0.0) for r in records) for p in PHASES}
    out["step"] = statistics.fmean(r[f"{clock}/step"] for r in records)
    return {k: round(v, 3) for k, v in out.items()}


def speedups(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """before / after per phase (phases that took time in both)."""
    return {k: round(before[k] / after[k], 2) for k in before
            if after.get(k, 0) > 0 and before[k] > 0}
