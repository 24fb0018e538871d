"""How the distributed optimizer's state is laid out in a checkpoint, and when it loads back.

Why a choice, and why `dp_reshardable` by default: megatron-core's
`fully_reshardable` gathers the whole optimizer state onto every DP rank before writing it
(`get_parameter_state_dp_zero(return_on_all_ranks=True)`, an NCCL all-gather: ~12 GB GPU and
~50 GB host per rank at 8B), and a load asks every rank for the whole state too. Its
`distrib_optim_fully_reshardable_mem_efficient` variant gathers over gloo onto DP rank 0 only,
which then writes alone. `dp_reshardable` writes each rank's own flat shard as it is: no
exchange, no extra buffer, every rank writes in parallel; it is Megatron-LM's default
(`training/checkpointing.py`, unless `--dist-ckpt-optim-fully-reshardable`) and NeMo's. What it
gives up: the optimizer state loads back only at the TP and PP it was written at (DP may
change). Weights always reshard (the model state is saved in model space), so a run can still
move to another TP/PP with `model.load` and a fresh optimizer, or be saved as
`fully_reshardable` for that purpose (`optimizer.checkpoint_format`).

A plain (non-distributed) optimizer's state is in model space whatever is asked: "plain".
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_calibclip.checkpoint.errors import CheckpointError

# optimizer.checkpoint_format values; the first is the default
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")
PLAIN = "plain"  # a non-distributed optimizer: model-space state, loadable at any layout
LEGACY = "fully_reshardable"  # what a checkpoint without the field was written with
_MODEL_SPACE = (PLAIN, "fully_reshardable", "fully_reshardable_mem_efficient")


def is_distributed(optimizer: Any) -> bool:
    """Does the (chained) megatron optimizer shard its state over DP?"""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def written_format(optimizer: Any, requested: str) -> str:
    """The format a save with `requested` actually writes for this optimizer."""
    if requested not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer format {requested!r}: expected one of {OPTIMIZER_FORMATS}")
    return requested if is_distributed(optimizer) else PLAIN


def sharded_metadata(fmt: str) -> dict[str, Any]:
    """megatron's sharded_state_dict metadata for format `fmt` (plain: model space)."""
    sharding = "fully_reshardable" if fmt in _MODEL_SPACE else fmt
    metadata: dict[str, Any] = {"distrib_optim_sharding_type": sharding,
                                # no per-sub-optimizer key prefix (plain and distributed
                                # optimizers share keys in model space)
                                "chained_optim_avoid_prefix": True}
    if fmt == "fully_reshardable_mem_efficient":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
    return metadata


def check_loadable(folder: Any, saved: str, saved_tp_pp: tuple[int, int],
                   optimizer: Any, current_tp_pp: tuple[int, int]) -> str:
    """The format to request when loading a checkpoint written as `saved` into `optimizer`;
    a CheckpointError (one line, what to do) where megatron could not load it."""
    distributed = is_distributed(optimizer)
    if saved in _MODEL_SPACE:  # model space: any optimizer, any layout
        return "fully_reshardable" if saved == PLAIN else saved
    if not distributed:
        raise CheckpointError(
            f"{folder}: its optimizer state is the distributed optimizer's own shards "
            f"({saved}); this run's optimizer is not distributed. Set "
            f"optimizer.distributed=true, or start from its weights (model.load) with a fresh "
            f"optimizer")
    if tuple(saved_tp_pp) != tuple(current_tp_pp):
        raise CheckpointError(
            f"{folder}: its optimizer state ({saved}) loads only at the TP x PP it was written "
            f"at ({saved_tp_pp[0]} x {saved_tp_pp[1]}), not {current_tp_pp[0]} x "
            f"{current_tp_pp[1]} (DP may change). Resume at that layout, start from its "
            f"weights (model.load) with a fresh optimizer, or save with "
            f"optimizer.checkpoint_format=fully_reshardable to move optimizer state")
    return saved


def give_state_for_load(optimizer: Any) -> None:
    """Adam moments for a distributed optimizer that has never stepped, so that megatron can
    build its load request (its `state_dict()` needs the inner optimizer's per-param 'step'
    where neither TE nor apex provides FusedAdam, as on the CPU). Megatron's own
    `_init_optimizer_states_with_dummy_values` (its FSDP load path): a step with zero
    gradients, whose every value the load then overwrites (main params included)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def restore_adam_steps(optimizer: Any, loaded: Any) -> None:
    """Each parameter's Adam step count, as saved, for torch's Adam inside a distributed
    optimizer (the CPU: neither TE's nor apex's FusedAdam, which keep the step per group).

    Why: megatron-core (0.16.1) puts the saved count into every parameter's state as one
    shared tensor, then copies the flat shards' state over it, 'step' included, whose
    value there is the load request's, not the checkpoint's; Adam's bias correction would then
    be a step behind (or ahead) and a resume would drift. The saved count is in the
    loaded param groups."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    states = [loaded] if len(chain) == 1 else [loaded[i] for i in range(len(chain))]
    for inner, state in zip(chain, states):
        if not isinstance(inner, DistributedOptimizer):
            continue
        groups = state["optimizer"]["param_groups"]
        steps = {g["step"] for g in groups if "step" in g}
        if len(steps) != 1:
            continue  # FusedAdam's per-group counts: megatron restores them itself
        step = float(steps.pop())
        for param_state in inner.optimizer.state.values():
            old = param_state.get("step")
            if torch.is_tensor(old):  # one tensor each, where torch's Adam keeps it
                param_state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)
