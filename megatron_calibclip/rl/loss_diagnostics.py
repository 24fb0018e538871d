"""The loss's own diagnostics: clip and phantom-clip counts by advantage sign, ratio extrema.

Why apart from the loss value: these counts never change the gradient; they are what the
trainer logs and what Calibrated Clipping is judged by (P(r < L | A<0), phantom clipping).
They are counts, not fractions (diagnostics.py says why), keyed as in diagnostics.FRACTIONS.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_calibclip.rl.diagnostics import count
from megatron_calibclip.rl.loss_config import LossConfig
from megatron_calibclip.rl.loss_inputs import TokenBatch
from megatron_calibclip.rl.surrogate import Surrogate


def clip_counts(batch: TokenBatch, sur: Surrogate, pg: Tensor) -> dict[str, Tensor]:
    """Tokens, sequences, A<0 / A>0 tokens and how many of each the bounds clipped.

    ``pg`` is the per-token surrogate after the correction weight (pg_loss_token_mean).
    """
    mask = batch.mask
    counts = dict(
        tokens=count(mask),
        seqs=count(mask.reshape(-1, mask.shape[-1]).any(dim=-1)),
        neg_tokens=count(sur.neg),
        pos_tokens=count(sur.pos),
        clip_lower_neg=count(sur.clip_lower),
        clip_upper_pos=count(sur.clip_upper),
        clipped_tokens=count(sur.clip_lower | sur.clip_upper),
        ratio_sum=count(torch.where(mask, sur.ratio, batch.zero)),
        pg_loss_sum=count(torch.where(mask, pg, batch.zero)),
    )
    if sur.dual is not None:
        counts["dual_clip_neg"] = count(sur.dual)
    return counts


def shadow_counts(batch: TokenBatch, sur: Surrogate, config: LossConfig) -> dict[str, Tensor]:
    """Phantom clips: A<0 tokens clipped at L (FP8) that BF16 (r_shadow >= 1 - eps_low) would keep.

    Also the shadow's own clip counts at the host bounds [1 - eps_low, 1 + eps_high] (upper
    only with shadow_eps_high). Nothing without a shadow log-ratio.
    """
    if batch.shadow is None:
        return {}
    r16 = torch.exp(batch.shadow.to(torch.float64))
    lo16 = 1.0 - float(config.shadow_eps_low)
    counts = {
        "phantom_clip_neg": count(sur.clip_lower & (r16 >= lo16)),
        "shadow_clip_lower_neg": count(sur.neg & (r16 < lo16)),
    }
    if config.shadow_eps_high is not None:
        counts["shadow_clip_upper_pos"] = count(sur.pos & (r16 > 1.0 + float(config.shadow_eps_high)))
    return counts


def ratio_extrema(batch: TokenBatch, ratio: Tensor) -> dict[str, Tensor]:
    """min / max of r over valid tokens (reduce across shards with MIN / MAX, not SUM)."""
    r_det = ratio.detach().to(torch.float64)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=r_det.device)
    return {  # where() instead of boolean indexing: no device sync
        "ratio_min": torch.where(batch.mask, r_det, inf).min(),
        "ratio_max": torch.where(batch.mask, r_det, -inf).max(),
    }
