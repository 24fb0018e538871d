"""Enumerate the layouts of a model on N GPUs, keep those that fit, recommend one.

Why this order of preference: data parallelism is the cheapest way to use GPUs (no
per-layer communication), so the smallest model-parallel group TP x PP that fits wins;
then no recomputation (it costs ~30% more compute for full), a resident reference (no
host<->device copy each step), TP before PP (TP stays on NVLink inside a node, PP adds
pipeline bubbles), and finally the most headroom. A layout that fits with less than
`margin_gib` to spare is recommended only when nothing fits with the margin: the estimate
is a model (docs/planner.md gives its measured error), not a measurement. The distributed
optimizer is always on when DP > 1: it only shards states and keeps the communication
volume of plain DP.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.planner.memory import Estimate, estimate
from megatron_calibclip.planner.params import check_layout
from megatron_calibclip.planner.spec import Hardware, Layout, Workload

RECOMPUTE_COST = {"none": 0, "selective": 1, "full": 2}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(m: ModelConfig, gpus: int, hardware: Hardware, base: Layout,
                      *, tp: Optional[int] = None, pp: Optional[int] = None,
                      recompute: Optional[Iterable[str]] = None,
                      offload: Optional[Iterable[bool]] = None) -> list[Layout]:
    """Every TP x PP x DP = gpus that Megatron accepts, times the memory switches."""
    out = []
    for t in ([tp] if tp else _divisors(gpus)):
        if t > hardware.gpus_per_node or gpus % t:
            continue
        for p in ([pp] if pp else _divisors(gpus // t)):
            if gpus % (t * p) or check_layout(m, t, p):
                continue
            d = gpus // (t * p)
            for r in (recompute or ("none", "selective", "full")):
                for o in (offload if offload is not None else (False, True)):
                    out.append(replace(base, tp=t, pp=p, dp=d, recompute=r,
                                       offload_reference=o,
                                       distributed_optimizer=base.distributed_optimizer and d > 1))
    return out


def preference(e: Estimate) -> tuple:
    lay = e.layout
    return (lay.tp * lay.pp, RECOMPUTE_COST[lay.recompute], lay.offload_reference, lay.pp,
            -e.headroom_gib)


def plan(m: ModelConfig, gpus: int, workload: Workload, hardware: Hardware = Hardware(),
         base: Layout = Layout(), name: str = "", **fixed) -> list[Estimate]:
    """Estimates of all candidate layouts, fitting ones first in order of preference."""
    estimates = [estimate(m, lay, workload, hardware, name)
                 for lay in candidate_layouts(m, gpus, hardware, base, **fixed)]
    return sorted(estimates, key=lambda e: (not e.fits, preference(e) if e.fits else e.peak))


DEFAULT_MARGIN_GIB = 5.0


def recommend(estimates: list[Estimate], margin_gib: float = DEFAULT_MARGIN_GIB
              ) -> Optional[Estimate]:
    """The preferred layout among those with `margin_gib` to spare, else among all that fit."""
    fitting = [e for e in estimates if e.fits]
    roomy = [e for e in fitting if e.headroom_gib >= margin_gib]
    pool = roomy or fitting
    return min(pool, key=preference) if pool else None
