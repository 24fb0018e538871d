"""The loss's correction term: the configured rollout correction applied to a batch.

Why apart from corrections.py: the registry sits below LossConfig (which checks a name
against it), while this term reads a prepared TokenBatch, which sits above LossConfig.
Same contract as the penalties: ``(batch, config) -> (weights or None, counts)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megatron_calibclip.rl.corrections import CORRECTIONS, rollout_log_weight
from megatron_calibclip.rl.diagnostics import count
from megatron_calibclip.rl.loss_config import LossConfig
from megatron_calibclip.rl.loss_inputs import TokenBatch


def rollout_correction(batch: TokenBatch, config: LossConfig) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The configured correction's weights (None: none) and counts, plus the probability error.

    Nothing without rollout log-probs; with them, mult_prob_error_sum (exp|log w|) always,
    is_weight_sum when the correction re-weights.
    """
    if batch.rollout is None:
        return None, {}
    log_w = rollout_log_weight(batch.old, batch.rollout, batch.mask)
    counts = {"mult_prob_error_sum": count(torch.where(batch.mask, torch.exp(log_w.abs()), batch.zero))}
    weights, own = CORRECTIONS[config.correction].fn(log_w, batch.mask, config)
    if weights is not None:
        counts["is_weight_sum"] = count(weights)
    counts.update(own)
    return weights, counts
