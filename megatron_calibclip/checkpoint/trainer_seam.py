"""CheckpointManager behind the trainer's `Checkpointer` seam (trainer/loop.py).

Why an adapter here and not in trainer/: checkpoint/ is floor 3 and must not import the
trainer, so the run's components are used by attribute only (ddp, optimizer, reference,
dataset, clipper). Step numbers differ by one between the two sides: the trainer passes the
index of the step it just finished and expects that index back from load_latest; the
manager counts completed steps (the step a resumed run starts with).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from megatron_calibclip.checkpoint.manager import CheckpointManager, Stateful
from megatron_calibclip.checkpoint.optimizer_format import OPTIMIZER_FORMATS


def _stateful(components: Any) -> dict[str, Stateful]:
    out: dict[str, Stateful] = {"dataset": components.dataset}  # the data cursor
    if getattr(components, "clipper", None) is not None:
        out["clipper"] = components.clipper
    return out


def _frozen(components: Any) -> dict[str, Any]:
    # the KL reference is a copy of the policy taken after warm-up; a resumed run skips the
    # warm-up, so the reference must come from the checkpoint
    ref = getattr(components, "reference", None)
    return {} if ref is None else {"reference": ref}


class TrainerCheckpointer:
    """`train(cfg, checkpointer=TrainerCheckpointer(run_dir / "checkpoints"))`."""

    def __init__(self, root: os.PathLike | str, *, keep_last: Optional[int] = None,
                 optimizer_format: str = OPTIMIZER_FORMATS[0]) -> None:
        self.manager = CheckpointManager(root, keep_last=keep_last,
                                         optimizer_format=optimizer_format)

    def has_checkpoint(self) -> bool:
        return self.manager.latest() is not None

    def save(self, step: int, components: Any) -> None:
        """Collective: after step index `step` finished."""
        self.manager.save(step + 1, components.ddp, components.optimizer,
                          stateful=_stateful(components), frozen=_frozen(components))

    def load_latest(self, components: Any) -> Optional[int]:
        """Collective: restore everything; the index of the last finished step, or None."""
        loaded = self.manager.load_latest(components.ddp, components.optimizer,
                                          stateful=_stateful(components),
                                          frozen=_frozen(components))
        return None if loaded is None else loaded.step - 1
