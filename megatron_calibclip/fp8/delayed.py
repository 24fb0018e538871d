"""Amax history of one tensor under delayed scaling (TE DelayedScaling), per module and role.

Why it is state: delayed scaling quantizes a tensor with a scale computed from the amaxes of
*earlier* steps, so the scale a token sees depends on what the module saw before, including
other micro-batches. That is one of the FP8 noise mechanisms the project reproduces.

When it updates (the TE order of operations):
  1. the tensor is quantized with the current `scale` (1.0 before the first update, as TE);
  2. its amax is max-reduced over `group` (if any) and recorded in the history;
  3. the next scale is computed from the history ("max" over the window or "most_recent").
Activations and weights update in the forward of FP8 mode (with or without grad), output
gradients in the backward. Nothing updates in fp32 / bf16 mode, so a BF16 shadow pass
leaves the FP8 state untouched.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_calibclip.fp8.formats import FP8Format
from megatron_calibclip.fp8.scales import delayed_scale
from megatron_calibclip.parallel.devices import HOST


class AmaxHistory:
    """The delayed-scaling state of one tensor: amax window + current scale."""

    def __init__(
        self,
        fmt: FP8Format,
        history_len: int,
        algo: str,
        margin: int,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.fmt = fmt
        self.algo = algo
        self.margin = margin
        self.group = group
        # on the host until the first amax arrives; record() moves them to its device
        self.history = torch.zeros(history_len, dtype=torch.float32, device=HOST)  # [0]: newest
        self.scale = torch.ones((), dtype=torch.float32, device=HOST)
        self.updates = 0  # how many amaxes were recorded (tests, logging)

    def record(self, amax: torch.Tensor) -> None:
        """Record this step's amax (reduced over the group) and compute the next scale."""
        amax = amax.detach().float().reshape(())
        if self.history.device != amax.device:  # live where the tensors are (NCCL needs CUDA)
            self.history = self.history.to(amax.device)
            self.scale = self.scale.to(amax.device)
        if self.group is not None and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            amax = amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        self.history = torch.roll(self.history, 1)
        self.history[0] = amax
        used = self.history.max() if self.algo == "max" else self.history[0]
        self.scale = delayed_scale(used, self.scale, self.fmt, self.margin)
        self.updates += 1

    def snapshot(self) -> "AmaxHistory":
        """A detached copy with no reduction group (to inspect without advancing the state)."""
        copy = AmaxHistory(self.fmt, len(self.history), self.algo, self.margin, None)
        copy.history, copy.scale = self.history.clone(), self.scale.clone()
        copy.updates = self.updates
        return copy
