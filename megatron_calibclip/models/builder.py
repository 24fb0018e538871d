"""Build megatron-core GPTModels for the policy and the reference model from a ModelConfig.

The policy trains (fp32 master weights on CPU; what the optimizer wraps on GPU); the
reference model is frozen, in eval mode, and may be held in BF16. Both come from the same
builder, so their architectures cannot drift apart. Call inside an initialised
model-parallel world (megatron_calibclip.parallel.initialize_distributed / model_parallel).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_calibclip.models.bf16_stack import install_bf16_boundaries
from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.models.init import initialize_weights
from megatron_calibclip.models.layer_specs import layer_spec, spec_backend


def to_transformer_config(
    cfg: ModelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: Optional[bool] = None,
    **extra,
) -> TransformerConfig:
    """Translate our ModelConfig (+ the current TP/PP sizes) into megatron's TransformerConfig.

    Fusions are off (they are CUDA kernels); dropout is 0 (RL fine-tuning does not use it and
    it would make log-probs stochastic). `use_cpu_initialization` defaults to True without
    CUDA: it makes the initial shards independent of TP (same seed -> same full weights).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cfg.check_tensor_parallel(tp)
    if cfg.num_layers % pp:
        raise ValueError(f"pipeline-parallel size {pp} must divide num_layers ({cfg.num_layers})")
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    kwargs = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu_initialization,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


def build_gpt_model(
    cfg: ModelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    spec: Optional[ModuleSpec] = None,
    backend: Optional[str] = None,
    seed: Optional[int] = None,
    initialize: bool = True,
    **config_extra,
) -> GPTModel:
    """One pipeline stage of the model described by `cfg` (pre/post process from PP rank).

    seed: if given, weights are drawn by models.init.initialize_weights, so that the same
    seed gives the same full weights at any TP/PP; if None, megatron's own initialisation.
    initialize=False: no initialisation at all (megatron's perform_initialization=False), for a
    model whose weights are loaded or copied next: at 32B a random init would draw every
    rank's shards (with use_cpu_initialization, full-size tensors on the host) only to be
    overwritten. Its weights hold whatever memory held until then.
    """
    if not initialize:
        if seed is not None:
            raise ValueError("build_gpt_model: a seed draws weights; initialize=False draws none")
        config_extra = {**config_extra, "perform_initialization": False}
    tconfig = to_transformer_config(cfg, params_dtype=params_dtype, **config_extra)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    spec = spec if spec is not None else layer_spec(cfg, backend)
    block_spec = spec
    block_norm = getattr(spec, "calibclip_block_norm", None)
    if block_norm is not None:  # the block's final norm, which no layer spec chooses
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )

        block_spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(tconfig), layer_norm=block_norm)
    model = GPTModel(
        config=tconfig,
        transformer_layer_spec=block_spec,
        vocab_size=cfg.padded_vocab_size(tp),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
    )
    model.calibclip_config = cfg  # what the model was built from (conversion, metrics)
    model.calibclip_backend = spec_backend(spec)  # "te" | "emulated" | "local": what was built
    if any(getattr(m, "_calibclip_emulated", False) for m in model.modules()):
        install_bf16_boundaries(model)  # a bf16 stack around the emulated linears
    if not initialize:
        _mark_tensor_parallel_weights(model)
    if seed is not None:
        initialize_weights(model, cfg, seed)
    return model


def _mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """The TP attributes (tensor_model_parallel, partition_dim, partition_stride) of megatron's
    local parallel layers' weights, which megatron-core sets only inside its weight
    initialisation (tensor_parallel/layers.py: `_initialize_affine_weight_cpu/_gpu` run under
    `if config.perform_initialization`); without them the gradient norm would count a TP-sharded
    weight as replicated, and resharding would cut a gated fc1 wrongly. The stride is the one
    megatron passes (transformer/mlp.py: 2 for a gated linear unit's fc1, [gate, up] interleaved
    per rank; 1 elsewhere); tests/trainer/test_load_without_init.py compares every attribute
    with an initialised build. TE's layers set theirs whatever the flag."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )
    from megatron.core.transformer.mlp import MLP

    strides = {}
    for module in model.modules():
        if isinstance(module, MLP) and module.config.gated_linear_unit \
                and not getattr(module.config, "use_kitchen", False):
            strides[id(module.linear_fc1)] = 2
    dims = ((ColumnParallelLinear, 0), (RowParallelLinear, 1), (VocabParallelEmbedding, 0))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        for cls, dim in dims:
            if isinstance(module, cls):
                set_tensor_model_parallel_attributes(weight, True, dim, strides.get(id(module), 1))
                break


def build_policy_model(cfg: ModelConfig, *, params_dtype: torch.dtype = torch.float32,
                       **kwargs) -> GPTModel:
    """The trainable policy (precision of the GEMMs is a model switch).

    fp32 params: the optimizer updates them directly and the GEMMs read their bf16 copy.
    bf16 params: megatron's mixed precision (its optimizer keeps the fp32 main params).
    """
    model = build_gpt_model(cfg, params_dtype=params_dtype,
                            bf16=params_dtype == torch.bfloat16, **kwargs)
    _cast_parameters(model, params_dtype)
    model.train()
    return model


def _cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every parameter in `dtype`: megatron creates norm weights in fp32 whatever
    params_dtype says (TE's norms on GPU follow params_dtype; so do ours)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)


def build_reference_model(
    cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, **kwargs
) -> GPTModel:
    """The frozen reference policy (KL anchor), held in `dtype` (BF16 by default)."""
    model = build_gpt_model(cfg, params_dtype=dtype, **kwargs)
    _cast_parameters(model, dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def place_on_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to(device)` and what `.to` does not move: RoPE's `inv_freq`, a plain attribute of
    megatron's RotaryEmbedding, made on the host under use_cpu_initialization and moved by
    megatron only inside the first forward. The trainer calls this right after building,
    before DDP and the optimizer (Megatron-LM's get_model: `model.cuda(...)`)."""
    model.to(device)
    for m in model.modules():
        inv_freq = getattr(m, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and inv_freq.device != torch.device(device):
            m.inv_freq = inv_freq.to(device)
    return model


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy parameters (same sharding) from src into dst, casting to dst's dtype.

    Used to initialise the reference model from the policy at the start of training.
    """
    dst_params = dict(dst.named_parameters())
    src_params = dict(src.named_parameters())
    if dst_params.keys() != src_params.keys():
        missing = sorted(set(src_params) ^ set(dst_params))
        raise ValueError(f"models differ in parameters: {missing[:5]}")
    with torch.no_grad():
        for name, p in src_params.items():
            dst_params[name].copy_(p.to(dst_params[name].dtype))
