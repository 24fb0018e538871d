"""Run a collective conversion on TP x PP ranks from a plain command line.

Why: writing a checkpoint at TP=2 x PP=2 needs 4 ranks, but `calibclip convert` is usually
typed without torchrun. Under torchrun/srun (or inside an existing world) the function runs
in this process; with one rank it runs in this process on a single-rank world; otherwise
TP x PP local processes are spawned on CPU/gloo (GPUs hidden: conversion needs no kernels).
Errors come back with the failing rank's message, never as a hang.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any, Callable

from megatron_calibclip.checkpoint.errors import CheckpointError, ConversionError

_CLEAN_ERRORS = (ConversionError, CheckpointError)


def _in_world(fn: Callable[..., Any], tp: int, pp: int, args: tuple) -> Any:
    from megatron_calibclip.parallel import model_parallel

    with model_parallel(tp=tp, pp=pp):
        return fn(*args)


def _worker(rank: int, world: int, init_file: str, tp: int, pp: int, fn, args, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        try:
            value = _in_world(fn, tp, pp, args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        clean = isinstance(err, _CLEAN_ERRORS)
        results.put((rank, False, (type(err).__name__, str(err), clean, traceback.format_exc())))


def run_on_ranks(fn: Callable[..., Any], *args: Any, tp: int = 1, pp: int = 1,
                 timeout_s: float = 3600.0) -> Any:
    """fn(*args) on every rank of a TP x PP world; returns rank 0's result."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _in_world(fn, tp, pp, args)
    world = tp * pp
    if os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or world == 1:
        from megatron_calibclip.parallel import ParallelLayout, initialize_distributed, teardown

        initialize_distributed(ParallelLayout(tp, pp))
        try:
            return fn(*args)
        finally:
            teardown()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # children run on CPU/gloo
    with tempfile.TemporaryDirectory(prefix="calibclip-convert-") as tmp:
        procs = [ctx.Process(target=_worker,
                             args=(r, world, os.path.join(tmp, "init"), tp, pp, fn, args,
                                   results))
                 for r in range(world)]
        try:
            for p in procs:
                p.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        answers: dict[int, tuple[bool, Any]] = {}
        try:
            while len(answers) < world:
                try:
                    rank, ok, payload = results.get(timeout=timeout_s)
                except queue.Empty:
                    late = sorted(set(range(world)) - set(answers))
                    raise RuntimeError(f"conversion ranks {late} did not finish within "
                                       f"{timeout_s:.0f}s") from None
                answers[rank] = (ok, payload)
                if not ok:
                    break  # others may be stuck in a collective: stop them below
        finally:
            for p in procs:
                p.join(timeout=5 if len(answers) < world else 60)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = sorted(r for r, (ok, _) in answers.items() if not ok)
    if failed:
        name, message, clean, tb = answers[failed[0]][1]
        if clean:
            raise ConversionError(message)
        raise RuntimeError(f"rank {failed[0]} failed with {name}: {message}\n{tb}")
    return answers[0][1]
