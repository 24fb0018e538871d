"""The same FP8Recipe on GPU: megatron-core TransformerConfig fields and TE autocast.

Why a pure mapping: which config fields a recipe sets (and which recipes TE cannot express)
must be testable on a CPU machine without Transformer Engine. Only `te_fp8_recipe` and
`te_fp8_autocast` import TE, lazily.

With the TE layer spec, megatron's TransformerBlock enters `fp8_autocast` itself from
`config.fp8` / `config.fp8_recipe` at every forward (fp8_utils.get_fp8_context), so FP8 on
and off is `config.fp8` set or None on the model's shared config (apply_te_precision, used
by precision.set_precision). The output layer and the embedding are outside the block and
stay high precision; norms run in high precision inside TE's fused norm+linear; the
attention softmax stays high precision (fp8_dot_product_attention=False).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Any, Iterator, Optional

import torch

from megatron_calibclip.config import ConfigError
from megatron_calibclip.fp8.recipe import LINEAR_VALUES, FP8Recipe

TE_GRANULARITIES = ("tensorwise", "delayed", "blockwise", "mxfp8")  # megatron fp8_recipe values


def transformer_engine_available() -> bool:
    """TE works only with CUDA (a TE install without CUDA breaks `import megatron.core`)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def te_config_kwargs(recipe: FP8Recipe) -> dict[str, Any]:
    """TransformerConfig keyword arguments that make megatron-core run `recipe` through TE.

    Raises ConfigError (naming the field and what TE allows) for settings that megatron-core
    (0.16.1 and 0.19.x alike) + TE cannot express; those exist only in our linears.
    """
    if recipe.granularity not in TE_GRANULARITIES:
        raise ConfigError(
            f"fp8.granularity: {recipe.granularity!r} has no Transformer Engine recipe in "
            f"megatron-core; allowed on the TE path: {list(TE_GRANULARITIES)}"
        )
    if set(recipe.linears) != set(LINEAR_VALUES):
        raise ConfigError(
            f"fp8.linears: TE runs every linear of the transformer layers in FP8; the TE "
            f"path allows only {list(LINEAR_VALUES)}, got {list(recipe.linears)}"
        )
    if not recipe.fp8_wgrad and recipe.granularity != "delayed":
        raise ConfigError(
            "fp8.fp8_wgrad: megatron-core honours fp8_wgrad=False only for the delayed "
            "recipe; allowed for this granularity: [True]"
        )
    if recipe.granularity == "delayed" and recipe.amax_reduction == "none":
        raise ConfigError(
            "fp8.amax_reduction: megatron-core always reduces delayed-scaling amaxes; allowed "
            "on the TE path: ['amax_group', 'tp']"
        )
    return {
        "fp8": recipe.format,  # 'e4m3' | 'hybrid'
        "fp8_recipe": recipe.granularity,  # 'tensorwise' | 'delayed' | 'blockwise' | 'mxfp8'
        "fp8_margin": recipe.margin,
        "fp8_amax_history_len": recipe.amax_history_len,
        "fp8_amax_compute_algo": recipe.amax_compute_algo,
        "fp8_wgrad": recipe.fp8_wgrad,
        "tp_only_amax_red": recipe.amax_reduction == "tp",
        "fp8_param": False,  # master weights stay high precision, re-quantized every forward
        "fp8_dot_product_attention": False,  # softmax / attention in high precision
        "fp8_multi_head_attention": False,
        "first_last_layers_bf16": False,
    }


def te_environment(recipe: FP8Recipe) -> dict[str, str]:
    """Environment variables TE reads (at import time) for scale options megatron-core's
    config does not carry. Set them before `import transformer_engine`."""
    te_config_kwargs(recipe)  # same validation
    env: dict[str, str] = {}
    if recipe.granularity == "blockwise" and not recipe.pow2_scales:
        env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "1"
    if recipe.granularity == "tensorwise" and recipe.pow2_scales:
        env["NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"] = "1"  # newer TE releases only
    return env


def te_token_multiple(recipe: FP8Recipe, tp: int = 1) -> int:
    """What the token count of every TE FP8 GEMM must divide by: megatron's own alignment
    (fp8_utils.get_fp8_align_size: 32 for mxfp8, else 16; TE's assert_dim_for_fp8_exec asks
    8 of the token dimension and 16 of the hidden one), times TP (sequence parallelism
    splits the tokens over the TP ranks)."""
    from megatron.core.fp8_utils import get_fp8_align_size

    return get_fp8_align_size(recipe.granularity) * max(1, tp)


# FP8 GEMMs per compute capability, from TE's own checks (transformer_engine.pytorch
# fp8/quantization: check_fp8_support >= 8.9; check_fp8_block_scaling_support: Hopper, 9.x,
# with CUDA >= 12.9; check_mxfp8_support >= 10.0)
_MIN_CAPABILITY = {"tensorwise": (8, 9), "delayed": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


def te_device_problem(recipe: FP8Recipe, capability: tuple[int, int],
                      cuda_version: Optional[str]) -> Optional[str]:
    """One line saying why this GPU cannot run `recipe` through TE, or None."""
    need = _MIN_CAPABILITY[recipe.granularity]
    cc = f"{capability[0]}.{capability[1]}"
    if tuple(capability) < need:
        alternative = " (Hopper: fp8.granularity blockwise or tensorwise)" \
            if recipe.granularity == "mxfp8" else ""
        return (f"fp8.granularity: {recipe.granularity!r} needs compute capability >= "
                f"{need[0]}.{need[1]}; this GPU has {cc}{alternative}")
    if recipe.granularity == "blockwise":
        if capability[0] != 9:
            return (f"fp8.granularity: 'blockwise' runs on Hopper (9.x) in Transformer Engine; "
                    f"this GPU has {cc}: use 'mxfp8'")
        if cuda_version is not None and tuple(int(x) for x in cuda_version.split(".")[:2]) < (12, 9):
            return (f"fp8.granularity: 'blockwise' needs CUDA >= 12.9 in Transformer Engine; "
                    f"this torch was built with CUDA {cuda_version}")
    return None


def te_environment_problem(recipe: FP8Recipe) -> Optional[str]:
    """One line when the environment Transformer Engine was (or will be) imported with does
    not give `recipe`'s scales, or None.

    Why: TE evaluates NVTE_FP8_BLOCK_SCALING_FP32_SCALES and
    NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES into its recipe classes' defaults when it is
    imported (transformer_engine/common/recipe: Float8BlockScaling.use_f32_scales,
    Float8CurrentScaling.use_power_2_scales), and megatron-core builds those classes without
    the scale fields (fp8_utils.get_fp8_recipe). Setting the variable after megatron-core
    imported TE changes nothing, so it must be in the environment the job starts with."""
    needed = te_environment(recipe)
    te_recipes = sys.modules.get("transformer_engine.common.recipe")
    if recipe.granularity == "blockwise":
        name, want_pow2 = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES", recipe.pow2_scales
        qparams = getattr(getattr(te_recipes, "Float8BlockScaling", None), "fp8_quant_fwd_inp", None)
        pow2 = getattr(qparams, "power_2_scale", None)  # None: TE not imported, or an older layout
        if pow2 is None:
            pow2 = os.environ.get(name, "0") != "1"
    elif recipe.granularity == "tensorwise":
        name, want_pow2 = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", recipe.pow2_scales
        if te_recipes is not None:
            pow2 = bool(getattr(te_recipes.Float8CurrentScaling, "use_power_2_scales", False))
        else:
            pow2 = os.environ.get(name, "0") == "1"
    else:
        return None
    if pow2 == want_pow2:
        return None
    value = needed.get(name, "0")
    return (f"fp8.power_of_two_scales: Transformer Engine gives this {recipe.granularity} recipe "
            f"{'power-of-two' if pow2 else 'fp32'} scales here; start the job with {name}={value} "
            f"in its environment (TE reads it once, when megatron-core imports it)")


def apply_te_precision(config: Any, mode: str, recipe: Optional[FP8Recipe]) -> None:
    """Set (mode "fp8") or clear (other modes) the FP8 fields of a TransformerConfig in place.

    On the TE path "bf16" and "fp32" both mean "FP8 off": the GEMMs then run in the
    parameters' dtype (BF16 under megatron's Float16Module).
    """
    if mode == "fp8":
        if recipe is None:
            raise ValueError("FP8 mode needs an FP8Recipe")
        for key, value in te_config_kwargs(recipe).items():
            setattr(config, key, value)
    else:
        config.fp8 = None


def te_fp8_recipe(recipe: FP8Recipe):
    """The TE recipe object megatron-core builds from the mapped config (needs TE + CUDA)."""
    from megatron.core.fp8_utils import get_fp8_recipe
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=1,
                            **te_config_kwargs(recipe))
    te_recipe = get_fp8_recipe(cfg)
    if te_recipe is None:
        raise RuntimeError("Transformer Engine is not available (needs CUDA + transformer-engine)")
    return te_recipe


@contextlib.contextmanager
def te_fp8_autocast(recipe: FP8Recipe, group=None) -> Iterator[None]:
    """TE's fp8_autocast with `recipe`, for TE modules used outside a TransformerBlock."""
    if not transformer_engine_available():
        raise RuntimeError("te_fp8_autocast needs CUDA and transformer-engine")
    import transformer_engine.pytorch as te

    with te.fp8_autocast(enabled=True, fp8_recipe=te_fp8_recipe(recipe), fp8_group=group):
        yield
