"""RL core: pure tensor functions for GRPO / DAPO with Calibrated Clipping.

Nothing here knows about process groups, models or the trainer: losses take log-probs,
advantages, masks and ratio bounds; data-parallel exactness is obtained by passing global
normalisers in and summing the returned counts out (see README.md in this folder).
"""
from megatron_calibclip.rl.advantages import dr_grpo_advantages, grpo_advantages, zero_variance_groups
from megatron_calibclip.rl.aggregation import AGG_MODES, LossAggMode, aggregate, masked_mean, masked_sum
from megatron_calibclip.rl.config import PolicyLossConfig, dapo_loss_config, grpo_loss_config
from megatron_calibclip.rl.corrections import (
    CORRECTION_MODES,
    CORRECTIONS,
    mis_weights,
    register_correction,
    rollout_log_weight,
    tis_weights,
)
from megatron_calibclip.rl.dapo import (
    DynamicSamplingBuffer,
    dynamic_sampling_filter,
    expand_group_mask,
    overlong_penalty,
)
from megatron_calibclip.rl.diagnostics import FRACTIONS, finalize_metrics, merge_counts, merge_extrema
from megatron_calibclip.rl.kl import KL_TYPES, kl_penalty
from megatron_calibclip.rl.loss_config import LossConfig
from megatron_calibclip.rl.loss_inputs import LossInputs
from megatron_calibclip.rl.policy_loss import compute_loss, policy_loss, ppo_clip_bounds
from megatron_calibclip.rl.reasoning_gym_reward import ReasoningGymReward
from megatron_calibclip.rl.rewards import (
    answers_match,
    extract_boxed,
    extract_final_answer,
    format_reward,
    math_reward,
    normalize_answer,
    parse_number,
    verify_math_answer,
)

__all__ = [
    "AGG_MODES",
    "CORRECTIONS",
    "CORRECTION_MODES",
    "FRACTIONS",
    "KL_TYPES",
    "DynamicSamplingBuffer",
    "LossAggMode",
    "LossConfig",
    "LossInputs",
    "PolicyLossConfig",
    "ReasoningGymReward",
    "aggregate",
    "answers_match",
    "compute_loss",
    "dapo_loss_config",
    "dr_grpo_advantages",
    "dynamic_sampling_filter",
    "expand_group_mask",
    "extract_boxed",
    "extract_final_answer",
    "finalize_metrics",
    "format_reward",
    "grpo_advantages",
    "grpo_loss_config",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "math_reward",
    "merge_counts",
    "merge_extrema",
    "mis_weights",
    "normalize_answer",
    "overlong_penalty",
    "parse_number",
    "policy_loss",
    "ppo_clip_bounds",
    "register_correction",
    "rollout_log_weight",
    "tis_weights",
    "verify_math_answer",
    "zero_variance_groups",
]
