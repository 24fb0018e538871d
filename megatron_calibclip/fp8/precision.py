"""The model-level precision switch: fp32, emulated bf16 or FP8, on the same weights.

Why a switch and not a second model: the BF16 shadow pass of Calibrated Clipping must see
exactly the master weights the FP8 pass sees. `set_precision` puts one shared
PrecisionState object into every emulated linear (they read it at each forward) and, for
Transformer Engine models, sets the FP8 fields of the shared TransformerConfig (the
TransformerBlock enters TE's fp8_autocast from them at each forward). No parameter is
copied, cast or re-registered.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Literal, Optional

import torch

from megatron_calibclip.fp8.delayed import batched_amax_reduction
from megatron_calibclip.fp8.recipe import FP8Recipe

Mode = Literal["fp32", "bf16", "fp8"]
MODE_VALUES: tuple[str, ...] = ("fp32", "bf16", "fp8")
_ATTR = "_calibclip_precision"


@dataclass
class PrecisionState:
    """Shared, mutable: what the emulated linears of one model compute in right now."""

    mode: Mode = "fp32"  # "fp32": megatron's own GEMM; "bf16"/"fp8": emulated
    recipe: Optional[FP8Recipe] = None  # the FP8 recipe (kept while in bf16/fp32 mode)


def rounds_activations(state: Optional[PrecisionState]) -> bool:
    """Whether a module holds bf16 activations now: bf16/fp8 mode, unless the recipe asks
    for fp32 activations (FP8Recipe.activation_precision)."""
    if state is None or state.mode not in ("bf16", "fp8"):
        return False
    return state.recipe is None or state.recipe.activation_precision == "bf16"


def emulated_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The emulated Column/RowParallelLinear modules of the transformer layers of `model`
    (the model itself included; not the bf16 output layer)."""
    return [m for m in model.modules() if getattr(m, "_calibclip_emulated", False)
            and getattr(m, "fp8_name", None) != "output"]


def precision_aware_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module that reads the model's PrecisionState: the emulated linears (output
    layer included) and the bf16-boundary modules of models/bf16_stack.py."""
    return [m for m in model.modules() if getattr(m, "_calibclip_emulated", False)
            or getattr(m, "_calibclip_precision_aware", False)]


def _te_configs(model: torch.nn.Module) -> list:
    """Distinct TransformerConfig objects of a model that was built with the TE layer spec.

    Decided by what was built (`model.calibclip_backend`, set by models.build_gpt_model from
    the spec), never by finding TE classes inside: with TE installed megatron gives non-TE
    models TE modules too (a TENorm), and an emulated model must stay emulated."""
    if getattr(model, "calibclip_backend", None) != "te":
        return []
    configs: dict[int, object] = {}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "fp8_recipe"):
            configs[id(cfg)] = cfg
    return list(configs.values())


def get_precision(model: torch.nn.Module) -> PrecisionState:
    """The state last set by `set_precision` (fp32 with no recipe if it was never set)."""
    state = getattr(model, _ATTR, None)
    return state if state is not None else PrecisionState()


def set_precision(
    model: torch.nn.Module, mode: Mode, recipe: Optional[FP8Recipe] = None
) -> PrecisionState:
    """Switch every emulated linear of `model` (and a TE model's FP8 config) to `mode`.

    mode "fp8" needs a recipe, given here or by an earlier call; a recipe given with
    "bf16"/"fp32" is remembered for the next "fp8". Returns the shared state.
    """
    if mode not in MODE_VALUES:
        raise ValueError(f"precision mode {mode!r} is not one of {list(MODE_VALUES)}")
    if recipe is not None and not isinstance(recipe, FP8Recipe):
        raise TypeError(f"recipe must be an FP8Recipe, got {type(recipe).__name__}")
    state = getattr(model, _ATTR, None)
    if state is None:
        state = PrecisionState()
    new_recipe = recipe if recipe is not None else state.recipe
    if mode == "fp8" and new_recipe is None:
        raise ValueError("set_precision(model, 'fp8') needs an FP8Recipe (recipe=...)")
    linears = emulated_linears(model)
    te_configs = _te_configs(model)
    if not linears and not te_configs:
        raise ValueError(
            "the model has no emulated linear layers and no Transformer Engine modules; "
            "build it with local_layer_spec(cfg, **fp8_linear_classes()) or the TE spec"
        )
    if te_configs:
        from megatron_calibclip.fp8.te import apply_te_precision

        for cfg in te_configs:  # validate + apply before any state changes hands
            apply_te_precision(cfg, mode, new_recipe)
    state.mode = mode
    state.recipe = new_recipe
    if te_configs and mode == "fp8" and hasattr(model, "set_is_first_microbatch"):
        # TE keeps the FP8 copy of each weight it quantized while is_first_microbatch is
        # False (megatron's TELinear.forward passes the flag, then clears it); megatron's
        # schedule sets it only for the first micro-batch of each forward_backward call
        # (schedules.forward_step). A forward in FP8 that enters here (after the BF16 shadow
        # pass, after an optimizer step) must quantize the current weights: set it for all.
        model.set_is_first_microbatch()
    for m in precision_aware_modules(model):
        m.precision_state = state
    setattr(model, _ATTR, state)
    return state


@contextlib.contextmanager
def precision(
    model: torch.nn.Module, mode: Mode, recipe: Optional[FP8Recipe] = None, *,
    batch_amax: bool = False,
) -> Iterator[PrecisionState]:
    """`with precision(model, "bf16"): ...` runs the block in `mode` and restores the
    previous mode and recipe afterwards, also on error (the BF16 shadow pass).

    batch_amax: reduce the block's delayed-scaling amaxes in batches (one collective per
    group per forward instead of one per tensor; fp8.delayed.batched_amax_reduction), for a
    block that every rank of the amax group runs alike, as a rollout's decode loop does."""
    previous = get_precision(model)
    prev_mode, prev_recipe = previous.mode, previous.recipe
    state = set_precision(model, mode, recipe)
    try:
        with batched_amax_reduction() if batch_amax else contextlib.nullcontext():
            yield state
    finally:
        restored = set_precision(model, prev_mode, prev_recipe)
        restored.recipe = prev_recipe  # also when the block's recipe replaced "no recipe"


def reset_fp8_state(model: torch.nn.Module) -> None:
    """Forget the delayed-scaling amax histories of every emulated linear (fresh start)."""
    for m in emulated_linears(model):
        m.reset_fp8_state()
