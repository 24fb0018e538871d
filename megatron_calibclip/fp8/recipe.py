"""The FP8 recipe: element formats, scaling granularity and which GEMMs run in FP8.

One typed, validated config drives both paths: the CPU emulation (fp8/quantize.py,
fp8/linear.py) and Transformer Engine on GPU (fp8/te.py maps it onto megatron-core's
TransformerConfig). Defaults follow Transformer Engine / Megatron-LM where they have one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from megatron_calibclip.config import ConfigError, from_dict
from megatron_calibclip.fp8.formats import E4M3, E5M2, FP8Format

Format = Literal["e4m3", "hybrid"]
Granularity = Literal["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"]
Role = Literal["activation", "weight", "grad"]
LinearName = Literal["qkv", "proj", "fc1", "fc2"]
AmaxAlgo = Literal["max", "most_recent"]
AmaxReduction = Literal["amax_group", "tp", "none"]
Backend = Literal["auto", "te", "torch", "emulated"]
WeightSource = Literal["bf16", "fp32"]

FORMAT_VALUES: tuple[str, ...] = ("e4m3", "hybrid")
GRANULARITY_VALUES: tuple[str, ...] = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
ROLE_VALUES: tuple[str, ...] = ("activation", "weight", "grad")
LINEAR_VALUES: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
AMAX_ALGO_VALUES: tuple[str, ...] = ("max", "most_recent")
AMAX_REDUCTION_VALUES: tuple[str, ...] = ("amax_group", "tp", "none")
BACKEND_VALUES: tuple[str, ...] = ("auto", "te", "torch", "emulated")
WEIGHT_SOURCE_VALUES: tuple[str, ...] = ("bf16", "fp32")

BLOCK = 128  # blockwise: 1 x BLOCK tiles (activations, gradients), BLOCK x BLOCK (weights)
MX_BLOCK = 32  # mxfp8: 1 x MX_BLOCK blocks, E8M0 scale


def _check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"fp8.{field}: {value!r} is not one of {list(allowed)}")


@dataclass(frozen=True)
class FP8Recipe:
    # "e4m3": every FP8 tensor in E4M3; "hybrid": E4M3 forward (activations, weights),
    # E5M2 output gradients (more range, less precision), as TE's Format.HYBRID.
    format: Format = "e4m3"
    # How scales are chosen. "tensorwise": current scaling, one scale per tensor from its
    # own amax (TE Float8CurrentScaling). "delayed": one scale per tensor from an amax
    # history of earlier steps (TE DelayedScaling). "rowwise": one scale per row along the
    # GEMM's reduction dim (torchao rowwise). "blockwise": 1x128 tiles for activations and
    # gradients, 128x128 blocks for weights (TE Float8BlockScaling, DeepSeek-V3).
    # "mxfp8": 1x32 blocks with E8M0 power-of-two scales (TE MXFP8BlockScaling, Blackwell).
    granularity: Granularity = "tensorwise"
    # delayed only: number of past amaxes kept per tensor (TE and Megatron-LM recipes: 1024).
    amax_history_len: int = 1024
    # delayed only: "max" uses the largest amax in the history, "most_recent" the last one.
    amax_compute_algo: AmaxAlgo = "max"
    # delayed only: scale = (fp8_max / amax) / 2**margin; a margin > 0 leaves headroom.
    margin: int = 0
    # delayed only: ranks whose amaxes are max-reduced before the scale update.
    # "amax_group" = megatron's amax group (TP x DP x CP, TE's default), "tp" = TP x CP
    # (megatron tp_only_amax_red), "none" = each rank alone (emulation only).
    amax_reduction: AmaxReduction = "amax_group"
    # Round scales down to a power of two (exact rescaling, one bit less precision).
    # None = the recipe's TE default: True for blockwise, False for tensorwise/rowwise;
    # always True (E8M0) for mxfp8; delayed supports only False.
    power_of_two_scales: Optional[bool] = None
    # Weight-gradient GEMM in FP8 (True, TE default) or in high precision (False,
    # Megatron --no-fp8-wgrad; megatron-core applies it to the delayed recipe only).
    fp8_wgrad: bool = True
    # Which linear layers of each transformer layer run in FP8; the others run in BF16.
    # Embedding, output layer, norms and the attention softmax are never FP8 (as in TE
    # and NeMo RL): they are not in this list on purpose.
    linears: tuple[LinearName, ...] = ("qkv", "proj", "fc1", "fc2")
    # What runs the FP8 GEMMs (fp8/backend.py): "emulated" (fp32 math on dequantized
    # operands, anywhere), "torch" (torch._scaled_mm on our quantizer's codes), "te"
    # (Transformer Engine), "auto" (te with CUDA + TE, else torch with CUDA, else emulated).
    backend: Backend = "auto"
    # What the weight quantizer reads: "bf16", the bf16 model copy of the fp32 master weight
    # (megatron's bf16 training with TE and fp8_param off, what GPU runs do); "fp32", the
    # master itself (today's research option; what fp8_param-style primary FP8 weights,
    # re-quantized from fp32 masters after each step, would see).
    weight_source: WeightSource = "bf16"
    # Activations between modules in "bf16" (fp8 and bf16 modes): embedding, norm, attention,
    # residual, GEMM inputs/outputs and logits hold bf16 values, as in megatron's bf16 stack
    # (models/bf16_stack.py). "fp32": only the GEMM operands are rounded (the earlier
    # emulation), to attribute noise to activation rounding or to check TP invariance.
    activation_precision: WeightSource = "bf16"

    def __post_init__(self) -> None:
        _check_choice("format", self.format, FORMAT_VALUES)
        _check_choice("backend", self.backend, BACKEND_VALUES)
        _check_choice("weight_source", self.weight_source, WEIGHT_SOURCE_VALUES)
        _check_choice("activation_precision", self.activation_precision, WEIGHT_SOURCE_VALUES)
        _check_choice("granularity", self.granularity, GRANULARITY_VALUES)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_ALGO_VALUES)
        _check_choice("amax_reduction", self.amax_reduction, AMAX_REDUCTION_VALUES)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ConfigError(
                f"fp8.amax_history_len: must be an integer >= 1, got {self.amax_history_len!r}"
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ConfigError(f"fp8.margin: must be an integer >= 0, got {self.margin!r}")
        if self.power_of_two_scales not in (None, True, False):
            raise ConfigError(
                f"fp8.power_of_two_scales: {self.power_of_two_scales!r} is not one of "
                f"[None, True, False]"
            )
        if self.granularity == "mxfp8" and self.power_of_two_scales is False:
            raise ConfigError(
                "fp8.power_of_two_scales: mxfp8 scales are E8M0 (always powers of two); "
                "allowed values for mxfp8 are [None, True]"
            )
        if self.granularity == "delayed" and self.power_of_two_scales:
            raise ConfigError(
                "fp8.power_of_two_scales: delayed scaling has no power-of-two option in "
                "Transformer Engine; allowed values for delayed are [None, False]"
            )
        if not isinstance(self.fp8_wgrad, bool):
            raise ConfigError(f"fp8.fp8_wgrad: expected true/false, got {self.fp8_wgrad!r}")
        linears = tuple(self.linears)
        for name in linears:
            _check_choice("linears[]", name, LINEAR_VALUES)
        if len(set(linears)) != len(linears):
            raise ConfigError(f"fp8.linears: duplicate entries in {list(linears)}")
        object.__setattr__(self, "linears", linears)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FP8Recipe":
        """Build from a YAML/JSON mapping; unknown keys and bad values name the field."""
        return from_dict(cls, data, "fp8")

    @property
    def pow2_scales(self) -> bool:
        """Whether scales are powers of two, after resolving the per-recipe default."""
        if self.granularity == "mxfp8":
            return True
        if self.power_of_two_scales is None:
            return self.granularity == "blockwise"
        return self.power_of_two_scales

    def element_format(self, role: Role) -> FP8Format:
        """E4M3 everywhere, except output gradients under "hybrid" (E5M2)."""
        _check_role(role)
        return E5M2 if (role == "grad" and self.format == "hybrid") else E4M3


def _check_role(role: str) -> None:
    if role not in ROLE_VALUES:
        raise ValueError(f"role {role!r} is not one of {list(ROLE_VALUES)}")
