"""CheckpointManager: the seam between a training loop and megatron's distributed checkpoints.

Why one object: a checkpoint is only useful for resuming if model, optimizer, calibration
state (CalibratedClipper), data cursor, step and every RNG are saved together and become
visible together. The trainer calls::

    ckpt = CheckpointManager(run_dir / "checkpoints")
    resumed = ckpt.load_latest(model, optimizer, stateful={"clipper": clipper})
    start = resumed.step if resumed else 0
    ...
    ckpt.save(step + 1, model, optimizer, stateful={"clipper": clipper},
              extra_state={"data_cursor": dataset.state_dict()})

Every rank calls save/load (they are collective). Model and optimizer go through megatron's
sharded_state_dict, so a checkpoint saved at one TP/PP/DP loads at another; the RNG states are
restored only when the layout is the same (they are per rank and have no meaning elsewhere).
Frozen models (the KL reference) are saved alongside under their own key prefix.
`extra_state` and the stateful objects are taken from rank 0 and must agree across ranks.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling

from megatron_calibclip import compat
from megatron_calibclip.checkpoint import layout as disk
from megatron_calibclip.checkpoint.errors import CheckpointError, DamagedCheckpointError
from megatron_calibclip.checkpoint.extra_state import check_absent_from_checkpoint, load_module_state
from megatron_calibclip.checkpoint.integrity import damaged_file
from megatron_calibclip.checkpoint.optimizer_format import (
    LEGACY as LEGACY_FORMAT,
    OPTIMIZER_FORMATS,
    check_loadable,
    give_state_for_load,
    restore_adam_steps,
    sharded_metadata,
    written_format,
)
from megatron_calibclip.checkpoint.info import CheckpointInfo, ParallelSizes
from megatron_calibclip.checkpoint.rng import capture_rng_state, restore_rng_state
from megatron_calibclip.checkpoint.strategy import StrategyName, save_strategy
from megatron_calibclip.parallel.flags import any_rank

logger = logging.getLogger(__name__)

STATE_KEY = "calibclip.state"  # rank 0's step, extra_state and stateful states (one object)
RNG_KEY = "calibclip.rng"  # one RNG snapshot per rank


# Contents tag of a checkpoint whose optimizer had not stepped yet (e.g. DAPO skipped every
# step so far): megatron cannot save an empty Adam state in a form it can load back (the load
# request always asks for exp_avg/exp_avg_sq), and a fresh optimizer is exactly that state.
FRESH_OPTIMIZER = "optimizer:fresh"


def _optimizer_has_state(optimizer: Any) -> bool:
    """Collective: has any rank's optimizer taken a step (Adam moments exist)?"""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any_rank(any(len(getattr(getattr(o, "optimizer", o), "state", {}) or {})
                        for o in inner))


class Stateful(Protocol):
    """Anything with state_dict()/load_state_dict(), e.g. calibration.CalibratedClipper."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path  # the checkpoint folder that was loaded
    step: int  # the step it was saved at (the next step to run)
    extra_state: dict[str, Any]  # what save() got as extra_state
    rng_restored: bool  # False when the parallel layout changed (RNGs then keep their state)
    info: CheckpointInfo  # the sidecar


ModelArg = Union[torch.nn.Module, Sequence[torch.nn.Module]]


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers down to the module that owns the parameters."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def _chunks(model: ModelArg) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return [unwrap_model(m) for m in chunks]


def _model_sharded_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """{"model": ...} or, for virtual pipeline chunks, {"model0": ..., "model1": ...}."""
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _frozen_sharded_state(frozen: Mapping[str, torch.nn.Module]) -> dict[str, Any]:
    return {f"frozen.{name}": unwrap_model(m).sharded_state_dict(prefix=f"{name}.")
            for name, m in frozen.items()}


def _merged_model_state(model_state: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for v in model_state.values():
        merged.update(v)
    return merged


class CheckpointManager:
    """Save and load complete training checkpoints under one root folder (see layout.py)."""

    def __init__(self, root: Union[str, os.PathLike], *, keep_last: Optional[int] = None,
                 strategy: StrategyName = "auto",
                 optimizer_format: str = OPTIMIZER_FORMATS[0]) -> None:
        """optimizer_format: how a distributed optimizer's state is written
        (checkpoint/optimizer_format.py: dp_reshardable by default)."""
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if optimizer_format not in OPTIMIZER_FORMATS:
            raise ValueError(f"optimizer_format must be one of {OPTIMIZER_FORMATS}, "
                             f"got {optimizer_format!r}")
        self.optimizer_format = optimizer_format
        self.root = Path(root)
        self.keep_last = keep_last
        self.strategy = strategy

    # ------------------------------------------------------------------ queries
    def latest(self) -> Optional[Path]:
        """The committed checkpoint folder, or None if nothing was saved yet."""
        return disk.read_latest(self.root) if self.root.exists() else None

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        model: ModelArg,
        optimizer: Any = None,
        *,
        stateful: Optional[Mapping[str, Stateful]] = None,
        extra_state: Optional[Mapping[str, Any]] = None,
        frozen: Optional[Mapping[str, torch.nn.Module]] = None,
    ) -> Path:
        """Write checkpoint `step` (collective) and make it `latest`; returns its folder.

        step: number of completed steps (a resumed run continues with this step).
        stateful: objects whose state_dict() is saved (rank 0's), e.g. {"clipper": clipper}.
        extra_state: plain picklable values (rank 0's), e.g. {"data_cursor": ...}.
        frozen: more models without optimizer state, e.g. {"reference": reference_model};
            their checkpoint keys get the prefix "<name>.".
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        final = self.root / disk.step_dirname(step)
        tmp = self.root / f"{disk.TMP_PREFIX}{final.name}"
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            disk.remove_stale(self.root)
            tmp.mkdir()
        dist.barrier()

        chunks = _chunks(model)
        model_state = _model_sharded_state(chunks)
        state: dict[str, Any] = dict(model_state)
        contents = ["model", "rng", "extra_state"]
        fmt = None
        if optimizer is not None and not _optimizer_has_state(optimizer):
            contents.append(FRESH_OPTIMIZER)
        elif optimizer is not None:
            fmt = written_format(optimizer, self.optimizer_format)
            state["optimizer"] = optimizer.sharded_state_dict(
                _merged_model_state(model_state), metadata=sharded_metadata(fmt))
            contents.append("optimizer")
        frozen = dict(frozen or {})
        state.update(_frozen_sharded_state(frozen))
        contents += [f"frozen:{name}" for name in sorted(frozen)]
        stateful = dict(stateful or {})
        contents += [f"stateful:{name}" for name in sorted(stateful)]
        payload = {
            "step": step,
            "extra_state": dict(extra_state or {}),
            "stateful": {name: obj.state_dict() for name, obj in stateful.items()},
        }
        state[STATE_KEY] = ShardedObject(STATE_KEY, payload, (1,), (0,), replica_id=rank)
        state[RNG_KEY] = ShardedObject(RNG_KEY, capture_rng_state(), (world,), (rank,),
                                       replica_id=0)
        state["step"] = step  # in the common state (0.16: common.pt, plain torch.load)
        dist_checkpointing.save(state, str(tmp), sharded_strategy=save_strategy(self.strategy))

        if rank == 0:
            cfg = getattr(chunks[0], "calibclip_config", None)  # set by models.build_gpt_model
            CheckpointInfo(
                step=step,
                layout=ParallelSizes.current(),
                contents=tuple(contents),
                model_config=None if cfg is None else dataclasses.asdict(cfg),
                megatron_core=compat.megatron_version(),  # the release, without a git suffix
                optimizer_format=fmt,
            ).write(tmp)
        dist.barrier()
        committed = [None]
        if rank == 0:
            committed[0] = disk.commit(tmp, final).name
            if self.keep_last is not None:
                disk.prune(self.root, self.keep_last)
        dist.broadcast_object_list(committed, src=0)
        return self.root / committed[0]

    # ------------------------------------------------------------------ load
    def load_latest(
        self,
        model: ModelArg,
        optimizer: Any = None,
        *,
        stateful: Optional[Mapping[str, Stateful]] = None,
        frozen: Optional[Mapping[str, torch.nn.Module]] = None,
        restore_rng: bool = True,
    ) -> Optional[LoadedCheckpoint]:
        """Load the committed checkpoint into model/optimizer/stateful; None if there is none.

        A damaged latest checkpoint (a file missing, truncated or unreadable) is skipped with
        a warning naming the file, and the newest intact older one is loaded; if none is
        intact, DamagedCheckpointError names them all.
        """
        path = self.latest()
        if path is None:
            return None
        older = sorted((c for c in self.root.iterdir() if c.is_dir() and c != path
                        and disk.step_of(c.name) is not None
                        and disk.step_of(c.name) < disk.step_of(path.name)),
                       key=lambda c: disk.step_of(c.name), reverse=True)
        damaged = []
        for candidate in [path, *older]:
            damage = _damage(candidate)
            if damage is None:
                if damaged and dist.get_rank() == 0:
                    what = "; ".join(damaged)
                    logger.warning("damaged checkpoint(s) skipped: %s; resuming from %s",
                                   what, candidate)
                    print(f"warning: damaged checkpoint(s) skipped: {what}; resuming from "
                          f"{candidate}, the newest intact one", file=sys.stderr, flush=True)
                return self._load_intact(candidate, model, optimizer, stateful=stateful,
                                         frozen=frozen, restore_rng=restore_rng)
            damaged.append(f"{candidate.name}/{damage}")
        raise DamagedCheckpointError(
            f"no intact checkpoint in {self.root}: {'; '.join(damaged)}; move the damaged "
            f"folders away, or start over with run.overwrite=true")

    def load(
        self,
        path: Union[str, os.PathLike],
        model: ModelArg,
        optimizer: Any = None,
        *,
        stateful: Optional[Mapping[str, Stateful]] = None,
        frozen: Optional[Mapping[str, torch.nn.Module]] = None,
        restore_rng: bool = True,
    ) -> LoadedCheckpoint:
        """Load checkpoint folder (or root with `latest`) `path`, at any TP/PP/DP (collective).

        optimizer=None loads the model only (e.g. to start training from converted weights).
        """
        folder = disk.resolve_checkpoint(path)
        damage = _damage(folder)
        if damage is not None:
            raise DamagedCheckpointError(f"checkpoint {folder} is damaged: {damage}")
        return self._load_intact(folder, model, optimizer, stateful=stateful, frozen=frozen,
                                 restore_rng=restore_rng)

    def _load_intact(self, folder: Path, model: ModelArg, optimizer: Any, *,
                     stateful: Optional[Mapping[str, Stateful]],
                     frozen: Optional[Mapping[str, torch.nn.Module]],
                     restore_rng: bool) -> LoadedCheckpoint:
        """`load` of a folder `_damage` has already passed (collective)."""
        info = CheckpointInfo.read(folder)
        refusal = compat.checkpoint_refusal(info.megatron_core)
        if refusal:
            raise CheckpointError(f"cannot load {folder}: {refusal}")
        if optimizer is not None and FRESH_OPTIMIZER in info.contents:
            optimizer = None  # saved before the first optimizer step: keep the fresh one
        elif optimizer is not None and "optimizer" not in info.contents:
            raise CheckpointError(f"{folder} holds no optimizer state (contents: "
                                  f"{', '.join(info.contents)}); load it with optimizer=None")
        stateful, frozen = dict(stateful or {}), dict(frozen or {})
        missing = [f"stateful:{n}" for n in stateful if f"stateful:{n}" not in info.contents]
        missing += [f"frozen:{n}" for n in frozen if f"frozen:{n}" not in info.contents]
        if missing:
            raise CheckpointError(f"{folder} holds no state for {missing} (contents: "
                                  f"{', '.join(info.contents)})")
        rank, world = dist.get_rank(), dist.get_world_size()
        current = ParallelSizes.current()
        same_layout = info.layout == current

        chunks = _chunks(model)
        model_state = _model_sharded_state(chunks)
        request: dict[str, Any] = dict(model_state)
        if optimizer is not None:
            fmt = check_loadable(folder, info.optimizer_format or LEGACY_FORMAT,
                                 (info.layout.tp, info.layout.pp), optimizer,
                                 (current.tp, current.pp))
            give_state_for_load(optimizer)
            request["optimizer"] = optimizer.sharded_state_dict(
                _merged_model_state(model_state), is_loading=True,
                metadata=sharded_metadata(fmt))
        request.update(_frozen_sharded_state(frozen))
        request[STATE_KEY] = ShardedObject(STATE_KEY, None, (1,), (0,), replica_id=rank)
        load_rng = restore_rng and same_layout
        if load_rng:
            request[RNG_KEY] = ShardedObject(RNG_KEY, None, (world,), (rank,), replica_id=0)
        try:  # RETURN_UNEXPECTED: what the checkpoint lacks is left out of the load and named
            loaded, _, absent = dist_checkpointing.load(
                request, str(folder), strict=StrictHandling.RETURN_UNEXPECTED)
        except Exception as err:  # megatron raises several types; name the folder
            raise CheckpointError(f"cannot load {folder}: {type(err).__name__}: {err}") from err
        kept = check_absent_from_checkpoint(folder, absent)  # TE extra states only

        for key, chunk in zip(model_state, chunks):
            kept += load_module_state(chunk, loaded.get(key, {}), f"{folder} into the model")
        for name, module in frozen.items():
            prefix = f"{name}."
            kept += load_module_state(
                unwrap_model(module),
                {k[len(prefix):]: v for k, v in loaded.get(f"frozen.{name}", {}).items()},
                f"{folder} into {name}")
        if kept and rank == 0:
            logger.info("checkpoint %s: %d Transformer Engine extra state(s) not in it, kept as "
                        "built (e.g. %s)", folder, len(set(kept)), sorted(kept)[0])
        if optimizer is not None:
            # no_grad: with fp32 parameters (the CPU) the distributed optimizer's main params
            # are views of the model's, which an in-place copy under autograd refuses
            with torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
            restore_adam_steps(optimizer, loaded["optimizer"])
        payload = loaded[STATE_KEY]
        for name, obj in stateful.items():
            obj.load_state_dict(payload["stateful"][name])
        if load_rng:
            restore_rng_state(loaded[RNG_KEY])
        elif restore_rng and rank == 0:
            logger.warning("checkpoint %s was saved at %s, loading at %s: RNG states not "
                           "restored", folder, info.layout, current)
        return LoadedCheckpoint(folder, int(payload["step"]), dict(payload["extra_state"]),
                                load_rng, info)


def _damage(folder: Path) -> Optional[str]:
    """Collective: "<file> <what is wrong>" if `folder` is damaged on any rank, else None, the
    same answer on every rank (a rank-local read error must not split them: the others would
    wait in the reader's collectives)."""
    bad = damaged_file(folder)
    if not any_rank(bad is not None):
        return None
    return f"{bad[0]} {bad[1]}" if bad else "a file is unreadable on another rank"


def load_weights(path: Union[str, os.PathLike], model: ModelArg) -> LoadedCheckpoint:
    """Model weights only (no optimizer, no RNG) from a checkpoint folder or root, at any
    layout: how a new run starts from converted HF weights (trainer `model.load`)."""
    return CheckpointManager(path).load(path, model, restore_rng=False)
