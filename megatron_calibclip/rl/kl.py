"""Per-token KL(pi_theta || pi_ref) estimators (Schulman's k1/k2/k3) for the KL penalty.

Why three: with samples from pi_theta and d = log pi_theta - log pi_ref,
  k1 = d                      unbiased, high variance, can be negative
  k2 = d^2 / 2                biased, low variance, >= 0 (its gradient is that of a
                              squared log-ratio, the usual choice for a *loss* term)
  k3 = exp(-d) - 1 + d        unbiased, low variance, >= 0 (GRPO's choice)
k3's exp(-d) explodes when pi_ref >> pi_theta, so (as in verl/slime) -d is clamped to
[-log_ratio_clamp, log_ratio_clamp] and k3 to [-k3_clamp, k3_clamp]; both clamps zero the
gradient beyond them, which is the point: one outlier token must not dominate the step.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatron_calibclip.rl import _validation as V

KLType = Literal["k1", "k2", "k3"]
KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3")


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kl_type: KLType = "k3",
    *,
    log_ratio_clamp: float = 20.0,
    k3_clamp: float = 10.0,
) -> Tensor:
    """Per-token KL estimate, same shape as ``logprobs``; differentiable w.r.t. logprobs.

    ``ref_logprobs`` is treated as a constant (detached).
    """
    V.check_choice("kl_type", kl_type, KL_TYPES)
    V.check_tensor("logprobs", logprobs)
    V.check_same_shape("ref_logprobs", ref_logprobs, logprobs.shape, "logprobs")
    d = logprobs - ref_logprobs.detach()
    if kl_type == "k1":
        return d
    if kl_type == "k2":
        return 0.5 * d * d
    neg = torch.clamp(-d, min=-log_ratio_clamp, max=log_ratio_clamp)  # log(pi_ref / pi_theta)
    return torch.clamp(torch.exp(neg) - 1.0 - neg, min=-k3_clamp, max=k3_clamp)
