"""The PPO clipped surrogate with independent [L, H] ratio bounds, and dual-clip.

Why bounds and not epsilons: Calibrated Clipping replaces [1 - eps_low, 1 + eps_high]
with a calibrated [L, H] that is neither symmetric nor tied to 1, and it changes between
steps; so the surrogate takes the ratio bounds themselves, as floats or 0-d tensors.

Per valid token, with r = exp(logp - logp_old) and advantage A:
    loss_t = -min(r A, clip(r, L, H) A)
so the gradient w.r.t. logp is exactly 0 where (A<0 and r<L) or (A>0 and r>H), and equals
the unclipped -A r elsewhere. Dual-clip (Ye et al. 2020) additionally bounds the loss of
negative-advantage tokens: for A<0 the objective is max(min(rA, clip(r)A), cA), i.e.
loss_t = min(loss_t, -c A), which also zeroes the gradient where r > c.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_calibclip.rl import _validation as V
from megatron_calibclip.rl.loss_config import LossConfig
from megatron_calibclip.rl.loss_inputs import TokenBatch


def ppo_clip_bounds(eps_low: float, eps_high: float) -> tuple[float, float]:
    """The host algorithm's bounds: (1 - eps_low, 1 + eps_high); GRPO 0.2/0.2, DAPO 0.2/0.28."""
    return 1.0 - eps_low, 1.0 + eps_high


def check_bounds(clip_low: float | Tensor, clip_high: float | Tensor) -> None:
    """0 <= L < H, both finite-or-+inf scalars (reads tensor values: syncs the device)."""
    lo = V.as_float("clip_low", clip_low)
    hi = V.as_float("clip_high", clip_high)
    if math.isnan(lo) or math.isinf(lo) or lo < 0:
        raise ValueError(f"clip_low must be a finite ratio >= 0 (e.g. 0.8), got {lo}")
    if math.isnan(hi):
        raise ValueError(f"clip_high must be a ratio > clip_low (e.g. 1.28), got {hi}")
    if lo >= hi:
        raise ValueError(
            f"clip_low={lo} must be < clip_high={hi} (they are ratio bounds such as 0.8 / 1.28, "
            "not epsilons)"
        )


def _bound(value: float | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().to(dtype=dtype, device=device)
    return torch.tensor(float(value), dtype=dtype, device=device)


@dataclass(frozen=True)
class Surrogate:
    """The per-token surrogate and the token sets the diagnostics count."""

    ratio: Tensor  # r = exp(clamp(logp - logp_old)), with grad; 1 under padding
    pg: Tensor  # -A * r_eff per token (before any correction weight)
    neg: Tensor  # valid tokens with A < 0
    pos: Tensor  # valid tokens with A > 0
    clip_lower: Tensor  # A<0 and r<L: gradient dropped
    clip_upper: Tensor  # A>0 and r>H: gradient dropped
    dual: Tensor | None  # A<0 and r_eff > c (None without dual-clip)


def clipped_surrogate(
    batch: TokenBatch, clip_low: float | Tensor, clip_high: float | Tensor, config: LossConfig
) -> Surrogate:
    """-min(rA, clip(r, L, H)A) per token, with dual-clip if configured."""
    dtype, dev = batch.zero.dtype, batch.zero.device
    log_ratio = torch.clamp(batch.logprobs - batch.old, min=-config.log_ratio_clamp, max=config.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    L, H = _bound(clip_low, dtype, dev), _bound(clip_high, dtype, dev)
    neg = batch.mask & (batch.adv < 0)
    pos = batch.mask & (batch.adv > 0)
    clip_lower = neg & (ratio < L)
    clip_upper = pos & (ratio > H)
    # where() instead of min(): same value as -min(rA, clip(r)A), but the zero-gradient set
    # is explicit and no 0 * inf appears in backward.
    r_eff = torch.where(clip_lower, L, torch.where(clip_upper, H, ratio))
    dual = None
    if config.dual_clip:
        c = torch.tensor(float(config.dual_clip_c), dtype=dtype, device=dev)
        dual = neg & (r_eff > c)
        r_eff = torch.where(dual, c, r_eff)
    return Surrogate(ratio, -batch.adv * r_eff, neg, pos, clip_lower, clip_upper, dual)
