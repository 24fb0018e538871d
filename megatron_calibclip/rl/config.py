"""The loss section of the trainer's YAML, with GRPO and DAPO presets.

Why here: the trainer's YAML needs one place where every loss option is declared with
its meaning and allowed values (loaded with megatron_calibclip.config.from_dict, which
rejects unknown keys and bad Literal values). The bounds in force at a step come from
Calibrated Clipping, so the config holds the host algorithm's epsilons, from which the
initial / uncalibrated bounds [1 - eps_low, 1 + eps_high] follow. The loss itself reads
a LossConfig (loss_config.py); ``loss_config()`` is the one mapping onto it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from megatron_calibclip.config import ConfigError
from megatron_calibclip.rl.corrections import CorrectionName
from megatron_calibclip.rl.loss_config import LossConfig


@dataclass
class PolicyLossConfig:
    # Host-algorithm clip epsilons: uncalibrated bounds are [1 - eps_low, 1 + eps_high]
    # (GRPO 0.2 / 0.2, DAPO clip-higher 0.2 / 0.28). Phantom-clip metrics use eps_low too.
    eps_low: float = 0.2
    eps_high: float = 0.2
    # Dual-clip for A<0 tokens: loss capped at -c*A (Ye et al. 2020); c must be > 1.
    dual_clip: bool = False
    dual_clip_c: float = 3.0
    # How per-token losses become a scalar: token-mean (DAPO), seq-mean-token-mean (GRPO),
    # seq-mean-token-sum-norm (Dr. GRPO). See rl/aggregation.py.
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "seq-mean-token-mean"
    )
    # Constant divisor of seq-mean-token-sum-norm (the generation budget); None = padded length.
    max_response_length: int | None = None
    # Rollout/trainer mismatch correction: none, tis (min(w, C)), mis-token / mis-seq
    # (w * 1[w <= C]), mis-token-two-sided (icepop-style, w * 1[C_low <= w <= C]);
    # w = pi_old / pi_rollout. The paper keeps token-level TIS, C = 2, on.
    correction: CorrectionName = "tis"
    # The cap C of TIS / threshold of MIS.
    correction_cap: float = 2.0
    # The lower threshold C_low of mis-token-two-sided (0 < C_low < correction_cap).
    correction_cap_low: float = 0.5
    # Sequence weight of mis-seq: product (exact sequence ratio) or geometric (per-token mean).
    mis_seq_weight: Literal["product", "geometric"] = "product"
    # KL penalty coefficient beta (0 disables the penalty; KL is still logged if a reference runs).
    kl_coef: float = 0.0
    # KL estimator: k1 (log-ratio), k2 (squared / 2), k3 (low-variance, clamped).
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    # Entropy bonus coefficient (0 disables it).
    entropy_coef: float = 0.0
    # |log r| is clamped to this before exp (overflow guard).
    log_ratio_clamp: float = 20.0

    def __post_init__(self) -> None:
        if not 0.0 < self.eps_low < 1.0:
            raise ConfigError(f"eps_low: {self.eps_low} must be in (0, 1) (an epsilon, not a ratio bound)")
        if not self.eps_high > 0.0:
            raise ConfigError(f"eps_high: {self.eps_high} must be > 0")
        if self.kl_coef < 0.0:
            raise ConfigError(f"kl_coef: {self.kl_coef} must be >= 0")
        if self.max_response_length is not None and self.max_response_length <= 0:
            raise ConfigError(f"max_response_length: {self.max_response_length} must be > 0")
        self.loss_config()  # every other field: checked where the loss defines it

    @property
    def default_bounds(self) -> tuple[float, float]:
        """The uncalibrated ratio bounds (1 - eps_low, 1 + eps_high)."""
        return 1.0 - self.eps_low, 1.0 + self.eps_high

    def loss_kwargs(self) -> dict[str, Any]:
        """Keyword options for policy_loss (everything but the bounds and the tensors)."""
        kw: dict[str, Any] = {
            "dual_clip": self.dual_clip,
            "dual_clip_c": self.dual_clip_c,
            "loss_agg_mode": self.loss_agg_mode,
            "correction": None if self.correction == "none" else self.correction,
            "correction_cap": self.correction_cap,
            "correction_cap_low": self.correction_cap_low,
            "mis_seq_weight": self.mis_seq_weight,
            "kl_coef": self.kl_coef,
            "kl_type": self.kl_type,
            "entropy_coef": self.entropy_coef,
            "log_ratio_clamp": self.log_ratio_clamp,
        }
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            kw["max_response_length"] = self.max_response_length
        return kw

    def loss_config(self, generation_budget: int | None = None) -> LossConfig:
        """The loss's config from this section: the one place the YAML maps onto the loss.

        The host epsilons are also the shadow's clip thresholds (phantom-clip metrics);
        seq-mean-token-sum-norm divides by max_response_length, or else by
        ``generation_budget`` (the trainer passes rollout.sampling.max_new_tokens).
        """
        kw = self.loss_kwargs()
        kw["correction"] = self.correction
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and kw["max_response_length"] is None:
            kw["max_response_length"] = generation_budget
        return LossConfig(**kw, shadow_eps_low=self.eps_low, shadow_eps_high=self.eps_high)


def grpo_loss_config(**overrides: Any) -> PolicyLossConfig:
    """GRPO baseline: eps 0.2/0.2, per-sequence mean, k3 KL with beta 1e-3 [ours: a common
    choice; DeepSeekMath used 0.04], token-level TIS C=2."""
    base = PolicyLossConfig(eps_low=0.2, eps_high=0.2, loss_agg_mode="seq-mean-token-mean", kl_coef=1e-3)
    return dataclasses.replace(base, **overrides)


def dapo_loss_config(**overrides: Any) -> PolicyLossConfig:
    """DAPO baseline: clip-higher 0.2/0.28, token-level mean, no KL, token-level TIS C=2."""
    base = PolicyLossConfig(eps_low=0.2, eps_high=0.28, loss_agg_mode="token-mean", kl_coef=0.0)
    return dataclasses.replace(base, **overrides)
