"""Layer specs: which megatron-core modules make up a decoder layer.

We start from megatron-core's own specs and swap submodules through ModuleSpec (no subclass
trees): on CPU (or without Transformer Engine) the local spec with SDPAttention as core
attention; with CUDA and TE, the TE spec. The linear classes of attention and MLP can be
swapped too: that is where the FP8 layers (emulated or TE) plug in.
"""
from __future__ import annotations

import copy
from typing import Optional

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_calibclip import compat
from megatron_calibclip.fp8 import fp8_linear_classes
from megatron_calibclip.fp8.te import transformer_engine_available
from megatron_calibclip.models.attention import SDPAttention
from megatron_calibclip.models.config import ModelConfig


def local_layer_spec(
    cfg: ModelConfig,
    *,
    column_linear: type = ColumnParallelLinear,
    row_linear: type = RowParallelLinear,
) -> ModuleSpec:
    """megatron's local spec (RMSNorm, QK-norm as configured) with SDPA core attention and the
    given linear classes for linear_qkv / linear_fc1 (column) and linear_proj / linear_fc2
    (row). The output layer and embedding are not part of the layer spec and stay as they are.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(
        get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    )
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = SDPAttention
    attn.linear_qkv = column_linear
    attn.linear_proj = row_linear
    mlp = compat.mlp_submodules(spec)
    mlp.linear_fc1 = column_linear
    mlp.linear_fc2 = row_linear
    return spec


def emulated_layer_spec(cfg: ModelConfig) -> ModuleSpec:
    """The local spec with emulated FP8/BF16 linears: precision is then a switch on the model
    (megatron_calibclip.fp8.set_precision / precision), no second copy of the weights."""
    return local_layer_spec(cfg, **fp8_linear_classes())


def te_layer_spec(cfg: ModelConfig) -> ModuleSpec:
    """megatron's Transformer Engine spec (fused norm+linear, TE attention, FP8-capable),
    with the padding-aware causal mask our batches need (`with_padding_causal_mask`)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    spec = with_padding_causal_mask(get_gpt_layer_with_transformer_engine_spec(
        qk_layernorm=cfg.qk_norm))
    spec.calibclip_backend = "te"  # read by build_gpt_model (spec_backend)
    return spec


def with_padding_causal_mask(spec: ModuleSpec) -> ModuleSpec:
    """A copy of `spec` whose self-attention masks causally and by our key padding.

    Why: our batches are left-padded and carry a bool key-padding mask [b, 1, 1, s], True =
    masked out (rollout/batch.py). megatron's specs declare attn_mask_type=causal, and
    Attention.forward hands that type to core attention; TE's DotProductAttention ignores
    attention_mask for "causal" (its docstring: the mask "should be 'None' for 'causal'"), so
    prompts would attend to their padding. "padding_causal" takes exactly our mask ("[batch_size,
    1, 1, seqlen_q] for self-attention ... True means the corresponding position is masked
    out"); megatron's TEDotProductAttention.forward passes the type through
    (attn_mask_type.name). Our SDPAttention (local spec) applies both anyway."""
    from megatron.core.transformer.enums import AttnMaskType

    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.params = {
        **(spec.submodules.self_attention.params or {}),
        "attn_mask_type": AttnMaskType.padding_causal}
    return spec


def spec_backend(spec: ModuleSpec) -> str:
    """What a layer spec builds: "te" (te_layer_spec), "emulated" (our FP8/BF16 linears in
    the local spec), or "local". Why a tag and not a look at the classes: with TE installed
    megatron puts TE modules (a TENorm) into non-TE models too, and the precision switch must
    not mistake our emulated model for a TE one (fp8/precision.py)."""
    tagged = getattr(spec, "calibclip_backend", None)
    if tagged is not None:
        return tagged
    attn = spec.submodules.self_attention.submodules
    linears = (attn.linear_qkv, attn.linear_proj, *_mlp_linears(spec))
    return "emulated" if any(getattr(c, "_calibclip_emulated", False) for c in linears) else "local"


def _mlp_linears(spec: ModuleSpec) -> tuple:
    mlp = compat.mlp_submodules(spec)
    return mlp.linear_fc1, mlp.linear_fc2


def layer_spec(
    cfg: ModelConfig,
    backend: Optional[str] = None,
    **linear_classes: type,
) -> ModuleSpec:
    """backend: 'te', 'local', 'emulated' (local + emulated FP8 linears), or None (TE when
    TE and CUDA are present, else local)."""
    if backend is None:
        backend = "te" if transformer_engine_available() and not linear_classes else "local"
    if backend == "te":
        if not transformer_engine_available():
            raise RuntimeError("the 'te' layer spec needs CUDA and transformer-engine")
        return te_layer_spec(cfg)
    if backend == "emulated":
        return emulated_layer_spec(cfg)
    if backend != "local":
        raise ValueError(
            f"layer spec backend {backend!r} is not one of ['te', 'local', 'emulated']")
    return local_layer_spec(cfg, **linear_classes)
