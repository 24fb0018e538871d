"""Helpers for rank bodies: process groups of 1, 2 and 4 ranks inside one 4-rank pool, and a
counter of torch.distributed collectives.

Why subgroups: a 4-rank pool costs ~30 s to start on 2 cores, so the 1- and 2-rank cases run
as data-parallel groups ([r] and [0,1]/[2,3]) inside it, exactly as a DP group of a larger job.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "gather",
               "scatter", "reduce_scatter_tensor", "all_to_all_single", "barrier")
_GROUPS: dict[int, tuple] = {}


def group_of(size: int):
    """(group, index of this rank in it) for contiguous groups of `size` ranks (None = world)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size == world:
        return None, rank
    if size not in _GROUPS:  # every rank creates every group, in the same order
        groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
        _GROUPS[size] = groups
    return _GROUPS[size][rank // size], rank % size


def count_collectives(fn):
    """Run fn() with every torch.distributed collective counted: (value, [(name, payload bytes)])."""
    calls, saved = [], {}
    for name in COLLECTIVES:
        orig = getattr(dist, name)
        saved[name] = orig

        def wrapper(*args, _orig=orig, _name=name, **kwargs):
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            calls.append((_name, 0 if t is None else t.numel() * t.element_size()))
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapper)
    try:
        return fn(), calls
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)
