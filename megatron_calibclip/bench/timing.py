"""Side-by-side timing for benchmarks: candidates interleaved round-robin, so that load from
other processes (this is a shared 2-core machine) hits all of them alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_times(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, dict]:
    """Run every fn once per round, round-robin, after one warm-up call each; the best (min)
    and the median seconds per call of each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: {"min_s": min(v), "median_s": statistics.median(v)} for k, v in times.items()}
