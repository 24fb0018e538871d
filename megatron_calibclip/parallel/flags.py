"""One boolean agreed by every rank of a group.

Why: "did any rank get a signal / fail / take an optimizer step?" decides whether every rank
enters the next collective; ranks that decide alone deadlock. One int32 all-reduce (MAX) on
the backend's device (NCCL needs a CUDA tensor).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_calibclip.parallel.devices import collective_device


def any_rank(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Collective: True on every rank of `group` (default: all) if `flag` is True on any."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())
