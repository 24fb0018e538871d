"""The ranks of `calibclip bench quantile`: spawning them under a deadline (never a hang), and
what each rank times and counts (wall time max over ranks, payload bytes of each collective)."""
from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

from megatron_calibclip.bench.quantile_methods import MIN_TOKENS, VARIANTS, baseline, estimator, make_tokens

COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "gather",
           "scatter", "reduce_scatter_tensor", "all_to_all_single")


# ----------------------------------------------------------------------------- spawning
class BenchError(RuntimeError):
    """The benchmark could not run to the end (a rank failed, or the deadline passed)."""


def spawn_ranks(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Start the ranks, wait for them under a deadline, return rank 0's rows."""
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="calibclip-bench-quantile-")
    out_path = os.path.join(tmp, "rows.json")
    threads = max(1, (os.cpu_count() or 1) // opts["ranks"])
    # Children inherit the environment at spawn: one OpenMP pool per rank, sized to the cores.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    ctx = None
    try:
        try:
            ctx = mp.start_processes(
                _rank_main, args=(opts, os.path.join(tmp, "rendezvous"), out_path, threads),
                nprocs=opts["ranks"], join=False, start_method="spawn")
        except Exception as err:  # noqa: BLE001 - report why the ranks could not start
            raise BenchError(f"could not start {opts['ranks']} rank(s): {err}") from err
        deadline = time.monotonic() + opts["timeout"]  # a stuck collective times out at the same limit
        while True:
            try:
                if ctx.join(timeout=0.5):
                    break
            except Exception as err:  # noqa: BLE001 - ProcessRaisedException / ProcessExitedException
                raise BenchError(f"a rank failed: {str(err).strip()}") from err
            if time.monotonic() > deadline:
                raise BenchError(f"the ranks did not finish within --timeout {opts['timeout']:g} s; "
                                 "killed them")
        if not os.path.exists(out_path):
            raise BenchError("the ranks exited without writing their results")
        with open(out_path) as f:
            return json.load(f)
    finally:
        if ctx is not None:
            for proc in ctx.processes:  # only the processes started above
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
        shutil.rmtree(tmp, ignore_errors=True)


def _rank_main(rank: int, opts: dict[str, Any], init_file: str, out_path: str, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=opts["ranks"], timeout=datetime.timedelta(seconds=opts["timeout"]))
    try:  # an exception reaches the parent with its traceback through torch.multiprocessing
        rows = _run_rank(rank, opts)
        if rank == 0:
            with open(out_path + ".tmp", "w") as f:
                json.dump(rows, f)
            os.replace(out_path + ".tmp", out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- one rank
def _counting(calls: list[tuple[str, int]]) -> Callable[[], None]:
    """Wrap torch.distributed collectives so each call appends (name, payload bytes); returns undo."""
    import torch
    import torch.distributed as dist

    saved = {}
    for name in COUNTED:
        if not hasattr(dist, name):
            continue
        orig = saved[name] = getattr(dist, name)

        def wrapper(*args, _orig=orig, _name=name, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()), None)
            tensors = first if isinstance(first, (list, tuple)) else [first]
            calls.append((_name, sum(t.numel() * t.element_size() for t in tensors
                                     if isinstance(t, torch.Tensor))))
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapper)

    def undo() -> None:
        for name, orig in saved.items():
            setattr(dist, name, orig)

    return undo


def _timed(fn: Callable[[], Any], all_reduce_max: Callable) -> tuple[Any, float, list[int]]:
    """(value, seconds max over ranks, payload bytes of each collective call on this rank)."""
    import torch
    import torch.distributed as dist

    from megatron_calibclip.parallel.devices import collective_device

    dist.barrier()
    calls: list[tuple[str, int]] = []
    undo = _counting(calls)
    try:
        t0 = time.perf_counter()
        value = fn()
        elapsed = time.perf_counter() - t0
    finally:
        undo()
    t = torch.tensor([elapsed], dtype=torch.float64, device=collective_device())
    all_reduce_max(t)
    return value, float(t), [b for _, b in calls]


def _run_rank(rank: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from megatron_calibclip.calibration import CalibrationConfig
    from megatron_calibclip.parallel.devices import collective_device

    def all_reduce_max(t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)

    configs = {name: CalibrationConfig(**VARIANTS[name]) for name in opts["variants"]}
    # warm-up (untimed): gloo connections, allocator, lazy imports
    warm = make_tokens(MIN_TOKENS * 10, rank, opts["seed"] + 1)
    for cfg in configs.values():
        estimator(cfg, *warm)
    baseline(*warm)

    rows = []
    for n in opts["tokens"]:
        local = make_tokens(n, rank, opts["seed"])
        times: dict[str, list[float]] = {name: [] for name in configs}
        times["baseline"] = []
        last: dict[str, tuple[Any, list[int]]] = {}
        for _ in range(opts["repeats"]):  # alternate the methods so that load hits both alike
            for name, cfg in configs.items():
                res, sec, calls = _timed(lambda cfg=cfg: estimator(cfg, *local), all_reduce_max)
                times[name].append(sec)
                last[name] = (res, calls)
            ex, sec, calls = _timed(lambda: baseline(*local), all_reduce_max)
            times["baseline"].append(sec)
            last["baseline"] = (ex, calls)
        # every rank must hold the same bounds (checked outside the timed region, uncounted)
        mine = torch.tensor([[last[nm][0].log_lower, last[nm][0].log_upper] for nm in configs]
                            + [[ex.log_lower, ex.log_upper]], dtype=torch.float64,
                            device=collective_device())
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        same = all(torch.equal(mine.nan_to_num(), other.nan_to_num()) for other in everyone)
        if rank != 0:
            continue
        ex, b_calls = last["baseline"]
        row: dict[str, Any] = {
            "tokens_per_rank": n,
            "tokens_global": n * opts["ranks"],
            "same_bounds_on_all_ranks": same,
            "baseline": {
                "wall_time_s": statistics.median(times["baseline"]),
                "wall_time_s_runs": times["baseline"],
                "bytes_per_rank": sum(b_calls),
                "collectives": len(b_calls),
                "bytes_per_collective": b_calls,
                "log_lower": ex.log_lower,
                "log_upper": ex.log_upper,
            },
            "estimator": {},
        }
        for name, cfg in configs.items():
            res, e_calls = last[name]
            if not res.ok:
                raise RuntimeError(f"estimator ({name}) fell back: {res.reason}")
            if sum(e_calls) != res.bytes_communicated or len(e_calls) != res.num_collectives:
                raise RuntimeError(f"estimator ({name}) reported {res.bytes_communicated} bytes in "
                                   f"{res.num_collectives} collectives, counted {e_calls}")
            err_l = res.log_lower - ex.log_lower
            err_h = res.log_upper - ex.log_upper
            err_h_same_l = res.log_upper - ex.upper_for(res.log_lower)
            row["estimator"][name] = {
                "wall_time_s": statistics.median(times[name]),
                "wall_time_s_runs": times[name],
                "bytes_per_rank": sum(e_calls),
                "collectives": len(e_calls),
                "bytes_per_collective": e_calls,
                "log_lower": res.log_lower,
                "log_upper": res.log_upper,
                "error_log_lower": err_l,
                "error_log_upper": err_h,
                "error_log_upper_for_returned_lower": err_h_same_l,
                "resolution": res.resolution,
            }
        rows.append(row)
    return rows
