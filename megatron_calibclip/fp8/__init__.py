"""FP8 recipes, their CPU emulation, and their mapping onto Transformer Engine (floor 1).

Knows quantization, recipes and TE; nothing about RL. See fp8/README.md.

Recipe and tensor-level emulation::

    from megatron_calibclip.fp8 import FP8Recipe, quantize_dequantize
    recipe = FP8Recipe(format="hybrid", granularity="blockwise")
    xq = quantize_dequantize(x, recipe, role="activation")   # same shape and dtype as x

Models (emulated linears through the layer spec; precision is a switch on the model)::

    from megatron_calibclip.fp8 import fp8_linear_classes, precision, set_precision
    spec = local_layer_spec(cfg, **fp8_linear_classes())
    model = build_policy_model(cfg, spec=spec, seed=0)        # starts in "fp32"
    set_precision(model, "fp8", recipe)                       # every forward now FP8
    with precision(model, "bf16"):                            # BF16 shadow pass, same weights
        ...

GPU: `te_config_kwargs(recipe)` -> TransformerConfig FP8 fields for the TE layer spec
(`build_policy_model(cfg, backend="te", **te_config_kwargs(recipe))`); `set_precision`
toggles `config.fp8` on such a model; `te_fp8_autocast(recipe)` for bare TE modules.
"""
from megatron_calibclip.fp8.delayed import AmaxHistory, PendingAmaxError, batched_amax_reduction
from megatron_calibclip.fp8.formats import E4M3, E5M2, FORMATS, FP8Format
from megatron_calibclip.fp8.linear import (
    EmulatedColumnParallelLinear,
    EmulatedRowParallelLinear,
    fp8_linear_classes,
)
from megatron_calibclip.fp8.precision import (
    PrecisionState,
    emulated_linears,
    get_precision,
    precision,
    reset_fp8_state,
    set_precision,
)
from megatron_calibclip.fp8.quantize import NonFiniteError, Quantized, quantize, quantize_dequantize
from megatron_calibclip.fp8.recipe import BLOCK, MX_BLOCK, FP8Recipe
from megatron_calibclip.fp8.te import (
    apply_te_precision,
    te_config_kwargs,
    te_environment,
    te_fp8_autocast,
    te_fp8_recipe,
    transformer_engine_available,
)

__all__ = [
    "BLOCK",
    "E4M3",
    "E5M2",
    "FORMATS",
    "MX_BLOCK",
    "NonFiniteError",
    "AmaxHistory",
    "PendingAmaxError",
    "batched_amax_reduction",
    "EmulatedColumnParallelLinear",
    "EmulatedRowParallelLinear",
    "FP8Format",
    "FP8Recipe",
    "PrecisionState",
    "Quantized",
    "apply_te_precision",
    "emulated_linears",
    "fp8_linear_classes",
    "get_precision",
    "precision",
    "quantize",
    "quantize_dequantize",
    "reset_fp8_state",
    "set_precision",
    "te_config_kwargs",
    "te_environment",
    "te_fp8_autocast",
    "te_fp8_recipe",
    "transformer_engine_available",
]
