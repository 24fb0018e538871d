"""A CPU stand-in for megatron's Transformer Engine layer spec: local modules that carry TE's
*semantics* where they differ from the local spec's, so that what TE would do on an H100 at
checkpoint load and in attention happens (and fails, where TE would) on a CPU.

What it carries, each read in the libraries' source (megatron-core 0.16.1 / 0.19.2, TE 2.11 /
2.18; docs/gpu.md lists the lines):
- module state: TE modules keep their FP8 metadata as an `_extra_state` (a uint8 tensor, empty
  while they hold none: TE `module/base.py` / `ops/op.py` get_extra_state). Megatron's TE spec
  makes the q/k norms `TENorm` (`extensions/transformer_engine_spec_provider.py` layer_norm),
  and with TE installed the block's final norm too (`transformer/transformer_block.py`
  LayerNormImpl = TENorm); their `_extra_state` is requested from a checkpoint as a
  ShardedObject, so a checkpoint written by the local spec (whose torch norms have none)
  lacks it. TE's `DotProductAttention` has an `_extra_state` too, but megatron's
  `TEDotProductAttention.sharded_state_dict` returns nothing for it (softmax_type vanilla),
  so it is never saved, and only TE's own load post-hook (which its authors call temporary)
  keeps a strict `load_state_dict` from failing on it; `te_missing_key_hook` models both.
- masks: with padding_causal in the sbhd layout, TE reduces the key-padding mask to lengths
  (`attention/dot_product_attention/utils.py` get_cu_seqlens: count of unmasked keys) and
  cuDNN's fused attention treats positions [0, len) of each row as the valid ones, wherever
  the mask put them; outputs past len are zero-filled.
The linears are our emulated FP8/BF16 ones (their `_extra_state` is megatron's local one,
None, which TE's linears load), so the stand-in computes what the emulated spec computes
whenever the layout is one both readings agree on.

Used by the tests and by `calibclip rehearse`; never selectable for a training run (no
config value builds it).
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_calibclip.models.attention import SDPAttention
from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.parallel.devices import HOST

def _empty_extra_state() -> torch.Tensor:
    """What a TE module without FP8 state checkpoints (TE module/base.py get_extra_state)."""
    return torch.empty(0, dtype=torch.uint8, device=HOST)  # TE serializes its state on the host


def _check_extra_state(state) -> None:
    # TE accepts None (nothing saved) or its serialized tensor; anything else is a bug upstream
    if state is not None and not isinstance(state, torch.Tensor):
        raise TypeError(f"TE extra state must be a tensor or None, got {type(state).__name__}")


class StandInTENorm(torch.nn.RMSNorm):
    """TE's RMSNorm as megatron's TENorm builds it: the same math as the local spec's torch
    RMSNorm, plus TE's `_extra_state` (so the checkpoint layout is TE's)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_ignored):
        if config.normalization != "RMSNorm":
            raise ValueError(f"the TE stand-in has RMSNorm only, not {config.normalization!r}")
        super().__init__(hidden_size, eps=eps)

    def get_extra_state(self) -> torch.Tensor:
        return _empty_extra_state()

    def set_extra_state(self, state) -> None:
        _check_extra_state(state)


class StandInTEDotProductAttention(SDPAttention):
    """Core attention with TE's DotProductAttention state and cuDNN's reading of the mask.

    te_missing_key_hook: TE 2.11 / 2.18 register a load_state_dict post-hook that drops
    'core_attention._extra_state' from the missing keys (dot_product_attention.py,
    remove_extra_states_check, "will phase out this hook"); False models a TE without it.
    """

    te_missing_key_hook = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.te_missing_key_hook:
            self.register_load_state_dict_post_hook(_drop_core_attention_extra_state)

    def get_extra_state(self) -> torch.Tensor:
        return _empty_extra_state()

    def set_extra_state(self, state) -> None:
        _check_extra_state(state)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Nothing, as megatron's TEDotProductAttention without a learnable softmax offset."""
        return {}

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        mask_type = attn_mask_type or self.attn_mask_type
        if attention_mask is None or mask_type != AttnMaskType.padding_causal:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        as_lengths, lengths = cudnn_length_mask(attention_mask)
        out = super().forward(query, key, value, as_lengths, attn_mask_type, attention_bias,
                              packed_seq_params)
        if query.shape[0] != key.shape[0]:
            raise ValueError("the TE stand-in reads padding masks of full sequences only "
                             "(no KV-cache decode: TE runs refuse rollout.engine megatron)")
        # cuDNN zero-fills the outputs of query positions past each row's length
        rows = torch.arange(out.shape[0], device=out.device).unsqueeze(1)  # [sq, 1]
        return out * (rows < lengths.view(1, -1)).unsqueeze(-1).to(out.dtype)


def cudnn_length_mask(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask cuDNN actually applies for a key-padding mask [b, 1, 1, s] (True = masked):
    each row's valid keys are [0, len), len = its count of unmasked keys (TE get_cu_seqlens).
    Returns (that mask in the same convention, the lengths [b])."""
    lengths = (~attention_mask.to(torch.bool)).reshape(attention_mask.shape[0], -1).sum(dim=1)
    cols = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    masked = cols.unsqueeze(0) >= lengths.unsqueeze(1)
    return masked[:, None, None, :], lengths


def _drop_core_attention_extra_state(module, incompatible_keys) -> None:
    # TE's hook, with its list handling made safe (TE removes while iterating)
    keep = [k for k in incompatible_keys.missing_keys if "core_attention._extra_state" not in k]
    incompatible_keys.missing_keys[:] = keep


def te_stand_in_layer_spec(cfg: ModelConfig) -> ModuleSpec:
    """The emulated spec with TE's module state and mask semantics (see the module docstring):
    core attention and q/k norms as TE's, padding_causal as the TE spec uses it, and the
    block's final norm (read by build_gpt_model) as megatron builds it with TE installed."""
    from megatron_calibclip.models.layer_specs import emulated_layer_spec, with_padding_causal_mask

    spec = with_padding_causal_mask(emulated_layer_spec(cfg))
    attn = spec.submodules.self_attention.submodules
    attn.core_attention = StandInTEDotProductAttention
    if cfg.qk_norm:
        attn.q_layernorm = StandInTENorm
        attn.k_layernorm = StandInTENorm
    spec.calibclip_backend = "emulated"  # the math is the emulated spec's (fp8/precision.py)
    spec.calibclip_block_norm = StandInTENorm  # megatron's LayerNormImpl with TE installed
    spec.calibclip_stand_in = "te"
    return spec
