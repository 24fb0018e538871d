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

Step 2's reduction is one tiny collective per tensor per forward, unless it runs inside
`batched_amax_reduction()`: there the amaxes wait and are reduced together, one collective per
group, as TE reduces a region's amaxes in one buffer (amax_and_scale_update over the global
buffer). A waiting amax is applied before the quantizers next read its scale
(`quantize_scale()`) or its next amax is recorded, so every quantization sees exactly the
scale it would have seen without batching; inspection (`scale`, `history`) never
communicates and refuses while an amax waits.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_calibclip.fp8.formats import FP8Format
from megatron_calibclip.fp8.scales import delayed_scale
from megatron_calibclip.parallel.devices import HOST


class PendingAmaxError(RuntimeError):
    """A delayed-scaling state was inspected while its amax waits in a batch."""


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
        self._history = torch.zeros(history_len, dtype=torch.float32, device=HOST)  # [0]: newest
        self._scale = torch.ones((), dtype=torch.float32, device=HOST)
        self.updates = 0  # how many amaxes were applied (a waiting one is not counted yet)
        self._batch: Optional[AmaxBatch] = None  # the batch holding this history's amax, if any
        self._detached = False  # a snapshot: its records apply at once, never join a batch

    @property
    def waiting(self) -> bool:
        """Whether an amax of this history waits in a batch (not yet reduced and applied)."""
        return self._batch is not None

    def quantize_scale(self) -> torch.Tensor:
        """The scale the next quantization uses. Inside a batch a waiting amax is reduced and
        applied first: a collective, so only from code every rank of the group runs alike
        (the quantizers and the weight cache)."""
        self._settle()
        return self._scale

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, for inspection: never communicates, so it refuses to answer
        while an amax waits (a rank-0 read would otherwise start a collective alone)."""
        self._refuse_if_waiting("scale")
        return self._scale

    @scale.setter
    def scale(self, value: torch.Tensor) -> None:
        self._refuse_if_waiting("scale")
        self._scale = value

    @property
    def history(self) -> torch.Tensor:
        self._refuse_if_waiting("history")
        return self._history

    @history.setter
    def history(self, value: torch.Tensor) -> None:
        self._refuse_if_waiting("history")
        self._history = value

    def _refuse_if_waiting(self, what: str) -> None:
        if self._batch is not None:
            raise PendingAmaxError(
                f"the delayed-scaling {what} was read inside batched_amax_reduction() while this "
                "tensor's amax waits for its reduction; read it after the block, or use "
                "quantize_scale() on every rank of the amax group")

    def _settle(self) -> None:
        if self._batch is not None:
            self._batch.flush()

    def record(self, amax: torch.Tensor) -> None:
        """Record this step's amax (reduced over the group) and compute the next scale;
        inside `batched_amax_reduction()` the reduction waits for the batch's flush."""
        amax = amax.detach().float().reshape(())
        self._settle()  # a second amax in one batch: the first is applied before it
        if _ACTIVE is not None and not self._detached:
            _ACTIVE.add(self, amax)
            return
        if self._reduces():
            amax = amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        self._apply(amax)

    def _reduces(self) -> bool:
        return (self.group is not None and dist.is_initialized()
                and dist.get_world_size(self.group) > 1)

    def _apply(self, amax: torch.Tensor) -> None:
        """Put an amax (already reduced) into the window and compute the next scale."""
        if self._history.device != amax.device:  # live where the tensors are (NCCL needs CUDA)
            self._history = self._history.to(amax.device)
            self._scale = self._scale.to(amax.device)
        self._history = torch.roll(self._history, 1)
        self._history[0] = amax
        used = self._history.max() if self.algo == "max" else self._history[0]
        self._scale = delayed_scale(used, self._scale, self.fmt, self.margin)
        self.updates += 1

    def snapshot(self) -> "AmaxHistory":
        """A detached copy with no reduction group, to quantize without advancing the state
        (the weight cache's verification). Like quantize_scale(), it first applies a waiting
        amax: inside a batch, call it only where every rank of the group does."""
        self._settle()
        copy = AmaxHistory(self.fmt, len(self._history), self.algo, self.margin, None)
        copy._history, copy._scale = self._history.clone(), self._scale.clone()
        copy.updates, copy._detached = self.updates, True
        return copy


class AmaxBatch:
    """The amaxes recorded in one batched region, not yet reduced: at most one per history."""

    def __init__(self) -> None:
        self._pending: list[tuple[AmaxHistory, torch.Tensor]] = []
        self.collectives = 0  # all-reduces issued by this batch's flushes (tests, benchmarks)

    def add(self, state: AmaxHistory, amax: torch.Tensor) -> None:
        state._batch = self
        self._pending.append((state, amax))

    def discard(self) -> None:
        """Drop every pending amax without communicating (a block that raised)."""
        for state, _ in self._pending:
            state._batch = None
        self._pending = []

    def flush(self) -> None:
        """Reduce every pending amax, one all-reduce (MAX) per (group, device), in the order
        the groups first recorded (the same on every rank: they run the same layers), then
        apply them in the order they were recorded."""
        pending, self._pending = self._pending, []
        for state, _ in pending:
            state._batch = None
        buckets: dict[tuple, list[int]] = {}
        for i, (state, amax) in enumerate(pending):
            if state._reduces():
                buckets.setdefault((id(state.group), amax.device), []).append(i)
        reduced = [amax for _, amax in pending]
        for members in buckets.values():
            stacked = torch.stack([reduced[i] for i in members])
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=pending[members[0]][0].group)
            self.collectives += 1
            for j, i in enumerate(members):
                reduced[i] = stacked[j]
        for (state, _), amax in zip(pending, reduced):
            state._apply(amax)


_ACTIVE: Optional[AmaxBatch] = None


@contextlib.contextmanager
def batched_amax_reduction() -> Iterator[AmaxBatch]:
    """Reduce the delayed-scaling amaxes recorded in the block together, one collective per
    group (per flush) instead of one per tensor; numerically the same as without it.

    The block must run the same quantizations on every rank of each amax group, as it must
    without batching. Nested blocks join the outermost. Inside it, reading a waiting
    history's `scale` raises PendingAmaxError rather than communicate. If the block raises,
    the waiting amaxes are dropped without communicating: the failing rank does not enter
    the flush (its peers wait in it, as they would have waited in the next per-tensor
    all-reduce), and a caller that catches the error keeps histories advanced only up to
    the last flush.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    batch = _ACTIVE = AmaxBatch()
    try:
        yield batch
    except BaseException:
        _ACTIVE = None
        batch.discard()
        raise
    _ACTIVE = None
    batch.flush()
