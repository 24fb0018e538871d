"""Rollout/trainer mismatch corrections: TIS and MIS importance weights.

Why: the rollout engine (FP8 kernels, another recipe) samples from mu, while the trainer
computes pi_old; the PPO ratio pi_theta/pi_old does not see that gap. Re-weighting each
token by w = pi_old/mu makes the gradient an estimate under the right distribution.
Raw weights have unbounded variance, so
  TIS (truncated IS):  weight = min(w, C)              - bias for variance, nothing dropped
  MIS (masked IS):     weight = w * 1[w <= C]          - drops outliers instead of biasing them
MIS can act per token or per sequence (a sequence whose weight W exceeds C is dropped
whole; its kept tokens are all weighted by W, the sequence-level estimator).
Weights are detached: they rescale the gradient, they are not optimised.

Note: TIS/MIS correct the rollout-vs-trainer ratio; they do not touch the trainer's own
PPO ratio noise that Calibrated Clipping targets (see the SPEC).
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatron_calibclip.rl import _validation as V

CorrectionMode = Literal["tis", "mis-token", "mis-seq"]
CORRECTION_MODES: tuple[str, ...] = ("tis", "mis-token", "mis-seq")
SeqWeight = Literal["product", "geometric"]


def rollout_log_weight(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log w = log pi_old - log mu per token, detached, 0 under padding."""
    log_w = (old_logprobs.detach() - rollout_logprobs.detach())
    return torch.where(mask, log_w, torch.zeros_like(log_w))


def tis_weights(log_w: Tensor, mask: Tensor, *, cap: float = 2.0) -> tuple[Tensor, Tensor]:
    """Token-level truncated IS. Returns (weights, capped) with capped = mask & (w > cap)."""
    V.check_positive("cap", float(cap))
    w = torch.exp(log_w.detach())
    capped = mask & (w > cap)
    weights = torch.where(mask, torch.clamp(w, max=cap), torch.zeros_like(w))
    return weights, capped


def mis_weights(
    log_w: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    level: Literal["token", "sequence"] = "token",
    seq_weight: SeqWeight = "product",
) -> tuple[Tensor, Tensor]:
    """Masked IS. Returns (weights, rejected) with rejected = valid tokens given weight 0.

    level="sequence": W_i = exp(sum_t log w_it) ("product", the exact sequence ratio) or
    exp(mean_t log w_it) ("geometric", length-independent; use it for long answers where the
    product's variance explodes). A 1-D input is one sequence.
    """
    V.check_positive("cap", float(cap))
    V.check_choice("level", level, ("token", "sequence"))
    log_w = log_w.detach()
    zero = torch.zeros_like(log_w)
    if level == "token":
        w = torch.exp(log_w)
        rejected = mask & (w > cap)
    else:
        V.check_choice("seq_weight", seq_weight, ("product", "geometric"))
        lw = torch.where(mask, log_w, zero)
        seq_log = lw.sum(dim=-1, keepdim=True)
        if seq_weight == "geometric":
            seq_log = seq_log / mask.sum(dim=-1, keepdim=True).clamp(min=1).to(lw.dtype)
        w = torch.exp(seq_log).expand_as(log_w)
        rejected = mask & (w > cap)
    weights = torch.where(mask & ~rejected, w, zero)
    return weights, rejected


def correction_weights(
    mode: CorrectionMode,
    log_w: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    seq_weight: SeqWeight = "product",
) -> tuple[Tensor, Tensor]:
    """Dispatch on mode: (weights, affected) where affected = capped (TIS) or rejected (MIS)."""
    V.check_choice("correction", mode, CORRECTION_MODES)
    if mode == "tis":
        return tis_weights(log_w, mask, cap=cap)
    level = "token" if mode == "mis-token" else "sequence"
    return mis_weights(log_w, mask, cap=cap, level=level, seq_weight=seq_weight)
