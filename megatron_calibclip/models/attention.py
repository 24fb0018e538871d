"""Core attention on torch.nn.functional.scaled_dot_product_attention, for the local spec.

Why: megatron-core's DotProductAttention builds its causal mask and score buffer on CUDA and
materialises the [b, h, s, s] scores; SDPA handles GQA natively (no K/V repetition), picks
the best CPU kernel and needs no buffer. Same constructor and forward signatures as
DotProductAttention, so it is swapped in through the layer spec (ModuleSpec), nothing else.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron_calibclip.fp8.formats import to_bf16_values
from megatron_calibclip.fp8.precision import rounds_activations


class SDPAttention(MegatronModule):
    """softmax(q k^T * scale + causal/padding mask) v over this rank's heads.

    Inputs q [sq, b, np, hn], k/v [sk, b, ng, hn] (ng query groups, np % ng == 0);
    output [sq, b, np * hn]. attention_mask: None (pure causal) or bool [b|1, 1|np, sq, sk]
    with True = masked out (megatron's convention). In the model's bf16/fp8 precision modes
    (fp8.set_precision) q, k, v and the output are rounded to bf16 values, as a bf16 stack's
    attention sees and returns them; the softmax itself runs in fp32.
    """

    _calibclip_precision_aware = True
    precision_state = None  # set by fp8.set_precision

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; use the TE spec")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("packed sequences are not supported by SDPAttention")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPAttention")
        rounding = rounds_activations(self.precision_state)
        if rounding:
            query, key, value = (to_bf16_values(t) for t in (query, key, value))
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        allowed = None
        if attention_mask is not None:
            allowed = ~attention_mask.to(torch.bool)
        if causal and (sq != sk or allowed is not None):
            # bottom-right aligned causal mask: query i sits at position sk - sq + i
            rows = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
            cols = torch.arange(sk, device=q.device).unsqueeze(0)
            causal_allowed = cols <= rows
            allowed = causal_allowed if allowed is None else (allowed & causal_allowed)
            causal = False
        if allowed is not None:
            # a row with nothing to attend to (a padding query) would give NaN: let it attend
            # everywhere; its output is garbage but finite and is masked out downstream
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        dropout = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=allowed,
            dropout_p=dropout,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=self.num_heads != self.num_groups,
        )
        out = out.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.head_dim)
        return to_bf16_values(out) if rounding else out
