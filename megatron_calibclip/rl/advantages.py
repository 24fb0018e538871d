"""Group-relative advantages (GRPO, Dr. GRPO): the group mean is the baseline, no critic.

For a prompt's G sampled answers with rewards r_1..r_G:
    GRPO      A_i = (r_i - mean(r)) / (std(r) + eps)
    Dr. GRPO  A_i =  r_i - mean(r)           (no std: it up-weights near-solved prompts)
Zero-variance groups (all rewards equal, and every group of size 1) carry no learning
signal: their advantages are set to exactly 0 rather than left to (r - mean) / eps, where
rounding of the mean could turn into a spurious +-1e-11/eps-sized signal. DAPO goes
further and drops such groups (dapo.dynamic_sampling_filter).

Rewards are [n_groups, G], or 1-D with ``group_size`` and each group's answers contiguous
(the layout every rollout engine produces with n samples per prompt).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megatron_calibclip.rl import _validation as V


def _grouped(rewards: Tensor, group_size: int | None) -> Tensor:
    V.check_tensor("rewards", rewards)
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size={group_size} disagrees with rewards.shape[1]={rewards.shape[1]}")
        grouped = rewards
    elif rewards.dim() == 1:
        if group_size is None:
            raise ValueError("group_size is required for 1-D rewards")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if rewards.numel() % group_size:
            raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
        grouped = rewards.reshape(-1, group_size)
    else:
        raise ValueError(f"rewards must be [n_groups, G] or 1-D, got shape {tuple(rewards.shape)}")
    if grouped.numel() == 0:
        raise ValueError("rewards is empty")
    if not bool(torch.isfinite(grouped).all()):
        raise ValueError("rewards contains NaN or inf")
    return grouped


def zero_variance_groups(rewards: Tensor, *, group_size: int | None = None) -> Tensor:
    """Bool [n_groups]: True where all rewards of the group are equal (exact comparison)."""
    g = _grouped(rewards, group_size)
    return g.amax(dim=1) == g.amin(dim=1)


def grpo_advantages(
    rewards: Tensor,
    *,
    group_size: int | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:
    """Per-answer advantages, same shape as ``rewards`` (float32 or wider).

    normalize_std=False is Dr. GRPO. unbiased_std follows torch.std (GRPO/verl/TRL use the
    unbiased estimate); a group of 1 is zero-variance by definition, never NaN.
    """
    g = _grouped(rewards, group_size)
    g = g.to(V.compute_dtype(g))
    mean = g.mean(dim=1, keepdim=True)
    adv = g - mean
    if normalize_std:
        if g.shape[1] > 1:
            std = g.std(dim=1, keepdim=True, unbiased=unbiased_std)
        else:
            std = torch.zeros_like(mean)
        adv = adv / (std + eps)
    flat = g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(rewards.shape)


def dr_grpo_advantages(rewards: Tensor, *, group_size: int | None = None) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): mean-centred rewards; pair with 'seq-mean-token-sum-norm'."""
    return grpo_advantages(rewards, group_size=group_size, normalize_std=False)
