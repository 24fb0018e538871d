"""The rest of a BF16 stack around the emulated linears: where megatron's bf16 model rounds.

Why: on a GPU cluster the model holds bf16 parameters (fp32 only in the optimizer) and bf16
activations, so the BF16 shadow and the FP8 run see bf16 embeddings, norms, residual stream,
attention inputs and logits. Emulating only the four linears of each layer left all of that
in fp32 and made the shadow (the calibration target) less noisy than on a GPU.

`install_bf16_boundaries(model)` makes a built GPTModel (emulated spec) round, in its "bf16"
and "fp8" precision modes only (and unless the recipe sets activation_precision "fp32"),
at every boundary where megatron's bf16 stack holds a bf16
tensor, computing in fp32 in between (cheap on CPU, no bf16 kernels):

| boundary | how |
|---|---|
| embedding output (= lookup of the bf16 embedding) | forward hook on `embedding` |
| norm weight and norm output (input, pre-MLP, Q/K, final) | RMSNorm/LayerNorm forward, statistics in fp32 |
| residual stream after each residual add | the layer's bias-dropout-add (not with `fp32_residual_connection`) |
| q, k, v into core attention and its output | `SDPAttention` (softmax in fp32 inside) |
| linear inputs, weights, bias and outputs (MLP activations, attention output) | emulated linears (fp8/linear.py) |
| logits (bf16 output layer, never FP8) | the output layer as an emulated linear named "output" |

The log-softmax of the loss runs in fp32 on the bf16 logits, as megatron's cross-entropy
does. In "fp32" mode nothing is rounded: the fp32 stack stays the truth.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_calibclip.fp8.formats import to_bf16_values
from megatron_calibclip.fp8.linear import OUTPUT_LAYER_NAME, EmulatedColumnParallelLinear
from megatron_calibclip.fp8.precision import PrecisionState, rounds_activations


class _PrecisionAware:
    """Receives the model's PrecisionState from fp8.set_precision (like the emulated linears)."""

    _calibclip_precision_aware = True
    precision_state: PrecisionState

    def _rounding(self) -> bool:
        return rounds_activations(getattr(self, "precision_state", None))


class BF16RMSNorm(_PrecisionAware, torch.nn.RMSNorm):
    """torch RMSNorm that, in bf16/fp8 mode, uses the bf16 weight and returns bf16 values
    (the mean square and rsqrt stay fp32, as in megatron's fused and torch norms)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._rounding():
            return super().forward(x)
        weight = to_bf16_values(self.weight) if self.weight is not None else None
        out = F.rms_norm(x.float(), self.normalized_shape, weight.float() if weight is not None
                         else None, self.eps)
        return to_bf16_values(out.to(x.dtype))


class BF16LayerNorm(_PrecisionAware, torch.nn.LayerNorm):
    """torch LayerNorm with the same bf16 boundaries as BF16RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._rounding():
            return super().forward(x)
        w = to_bf16_values(self.weight).float() if self.weight is not None else None
        b = to_bf16_values(self.bias).float() if self.bias is not None else None
        out = F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)
        return to_bf16_values(out.to(x.dtype))


class _RoundingBDA:
    """Wraps a TransformerLayer's bias-dropout-add factory: the residual sum it returns is
    rounded to bf16 in bf16/fp8 mode (a bf16 residual stream)."""

    def __init__(self, factory, state_of):
        self.factory, self.state_of = factory, state_of

    def __call__(self, training: bool, fused: bool):
        inner = self.factory(training, fused)

        def bda(x_with_bias, residual, prob):
            out = inner(x_with_bias, residual, prob)
            return to_bf16_values(out) if rounds_activations(self.state_of()) else out

        return bda


def _swap_class(module: torch.nn.Module, new_class: type) -> None:
    """Give an already-built module a subclass of its own class (same state, new forward)."""
    if not issubclass(new_class, type(module)):
        raise TypeError(f"{new_class.__name__} is not a subclass of {type(module).__name__}")
    module.__class__ = new_class


def install_bf16_boundaries(model: torch.nn.Module) -> torch.nn.Module:
    """Make a built GPTModel stage round at the bf16 boundaries in bf16/fp8 mode (table above).

    Idempotent. The modules get the model's PrecisionState from `fp8.set_precision`; hooks
    read it from the model at call time.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_calibclip.fp8.precision import get_precision

    if getattr(model, "_calibclip_bf16_boundaries", False):
        return model
    state_of = lambda: get_precision(model)  # noqa: E731  (the state set_precision installed)
    for module in list(model.modules()):
        if type(module) is torch.nn.RMSNorm:
            _swap_class(module, BF16RMSNorm)
        elif type(module) is torch.nn.LayerNorm:
            _swap_class(module, BF16LayerNorm)
        elif isinstance(module, TransformerLayer) and not module.config.fp32_residual_connection:
            module.self_attn_bda = _RoundingBDA(module.self_attn_bda, state_of)
            module.mlp_bda = _RoundingBDA(module.mlp_bda, state_of)
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        def round_embedding(_module, _args, out):
            return to_bf16_values(out) if rounds_activations(state_of()) else out

        embedding.register_forward_hook(round_embedding)
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None and not getattr(output_layer, "_calibclip_emulated", False):
        # the ColumnParallelLinear GPTModel built gets the emulated GEMM: bf16 operands and
        # bf16 logits in bf16/fp8 mode, megatron's own GEMM in fp32 mode; named "output",
        # which no recipe lists, so it never runs in FP8 (as in TE and NeMo RL)
        _swap_class(output_layer, EmulatedColumnParallelLinear)
        output_layer._init_emulation(OUTPUT_LAYER_NAME)
    model._calibclip_bf16_boundaries = True
    return model
