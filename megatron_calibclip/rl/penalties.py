"""Per-token penalty terms added to the surrogate: the KL penalty and the entropy bonus.

Why one contract: ``term(batch, config) -> (addend, counts)``. ``addend`` is the per-token
value added to the loss (None when the term is off or its tensor is absent), ``counts``
the summable numerators it logs even when its coefficient is 0 (kl_mean, entropy_mean).
The loss adds the terms of PENALTIES in order; a new penalty is one function appended there.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from megatron_calibclip.rl.diagnostics import count
from megatron_calibclip.rl.kl import kl_penalty
from megatron_calibclip.rl.loss_config import LossConfig
from megatron_calibclip.rl.loss_inputs import TokenBatch

Term = tuple[Tensor | None, dict[str, Tensor]]


def kl_term(batch: TokenBatch, config: LossConfig) -> Term:
    """+ kl_coef * KL_t (k1/k2/k3 of logp - logp_ref); logs kl_sum whenever ref log-probs exist."""
    if batch.ref is None:
        return None, {}
    kl = torch.where(batch.mask, kl_penalty(batch.logprobs, batch.ref, config.kl_type), batch.zero)
    return (config.kl_coef * kl if config.kl_coef != 0.0 else None), {"kl_sum": count(kl)}


def entropy_term(batch: TokenBatch, config: LossConfig) -> Term:
    """- entropy_coef * H_t (a bonus: higher entropy, lower loss); logs entropy_sum."""
    if batch.entropy is None:
        return None, {}
    bonus = -config.entropy_coef * batch.entropy if config.entropy_coef != 0.0 else None
    return bonus, {"entropy_sum": count(batch.entropy)}


PENALTIES: tuple[Callable[[TokenBatch, LossConfig], Term], ...] = (kl_term, entropy_term)
