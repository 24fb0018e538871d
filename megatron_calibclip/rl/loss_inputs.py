"""What the policy loss reads: the input record, its checks, and the cleaned token batch.

Why a record: the loss used to take its tensors as loose keywords next to its options, so
a caller could not see which inputs exist and what each one enables. LossInputs holds one
micro-batch's tensors and the step's normalisers; LossConfig (loss_config.py) holds the
options. ``prepare_batch`` checks both against each other (shapes, an option without the
tensor it needs, NaN at a valid position) and returns a TokenBatch: every tensor in the
compute dtype and zero under padding, so no term has to care about padding again.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from megatron_calibclip.rl import _validation as V
from megatron_calibclip.rl.loss_config import LossConfig


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch: [batch, seq] tensors (a 1-D [seq] tensor is one sequence)."""

    logprobs: Tensor  # log pi_theta of the sampled tokens; the gradient flows here
    old_logprobs: Tensor  # log pi_old (trainer precision, before this step's updates)
    advantages: Tensor  # per token, or per sequence ([batch], broadcast over seq)
    mask: Tensor  # bool, True at tokens that count (response tokens)
    rollout_logprobs: Tensor | None = None  # log mu of the rollout engine: correction, probability error
    ref_logprobs: Tensor | None = None  # reference policy: KL penalty / kl_mean
    entropy: Tensor | None = None  # per-token entropy, with grad: entropy bonus / entropy_mean
    shadow_log_ratio: Tensor | None = None  # BF16 shadow log r of the same tokens: phantom-clip counts
    num_tokens: float | Tensor | None = None  # valid tokens of the whole step, all DP ranks (token-mean)
    num_sequences: float | Tensor | None = None  # sequences of the whole step, all DP ranks (seq modes)
    seq_num_tokens: Tensor | None = None  # [batch] each sequence's full token count (context parallel)


OPTIONAL_TENSORS: tuple[str, ...] = ("rollout_logprobs", "ref_logprobs", "entropy", "shadow_log_ratio")
INPUT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(LossInputs))


@dataclass(frozen=True)
class TokenBatch:
    """Checked inputs in the compute dtype, zero under padding: what every term reads."""

    mask: Tensor
    logprobs: Tensor  # with grad
    old: Tensor
    adv: Tensor  # per token
    zero: Tensor  # 0-d zero of the compute dtype
    rollout: Tensor | None
    ref: Tensor | None
    entropy: Tensor | None  # with grad
    shadow: Tensor | None


def _expand_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    V.check_tensor("advantages", advantages)
    if advantages.shape == shape:
        return advantages
    if len(shape) == 2 and advantages.shape == shape[:1]:
        return advantages.unsqueeze(-1).expand(shape)
    allowed = f"{tuple(shape)}" + (f" or {tuple(shape[:1])}" if len(shape) == 2 else "")
    raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {allowed}")


def _check_needs(inputs: LossInputs, config: LossConfig) -> None:
    """An option that needs a tensor the caller did not give is an error, never a no-op."""
    if config.correction != "none" and inputs.rollout_logprobs is None:
        raise ValueError(f"correction={config.correction!r} needs rollout_logprobs")
    if config.kl_coef != 0.0 and inputs.ref_logprobs is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs")
    if config.entropy_coef != 0.0 and inputs.entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy")
    if inputs.shadow_log_ratio is not None and config.shadow_eps_low is None:
        raise ValueError("shadow_log_ratio needs shadow_eps_low (the host eps_low, e.g. 0.2)")


def _check_values(inputs: LossInputs) -> None:
    """NaN/inf only under padding, and at least one valid token (these sync the device)."""
    mask = inputs.mask
    V.check_nonempty_mask(mask)
    for name in ("logprobs", "old_logprobs") + OPTIONAL_TENSORS:
        t = getattr(inputs, name)
        if t is not None:
            V.check_finite_where(name, t, mask)
    if inputs.advantages.shape == mask.shape:
        V.check_finite_where("advantages", inputs.advantages, mask)
    else:  # per-sequence: only sequences with a valid token matter
        V.check_finite_where("advantages", inputs.advantages, mask.any(dim=-1))


def prepare_batch(inputs: LossInputs, config: LossConfig, *, validate: bool = True) -> TokenBatch:
    """Check the inputs (values only with ``validate``) and clean them for the terms."""
    V.check_token_shape("logprobs", inputs.logprobs)
    shape = inputs.logprobs.shape
    V.check_same_shape("old_logprobs", inputs.old_logprobs, shape, "logprobs")
    mask = V.check_mask(inputs.mask, shape)
    adv = _expand_advantages(inputs.advantages, shape)
    for name in OPTIONAL_TENSORS:
        if getattr(inputs, name) is not None:
            V.check_same_shape(name, getattr(inputs, name), shape, "logprobs")
    _check_needs(inputs, config)
    if validate:
        _check_values(inputs)
    dtype = V.compute_dtype(inputs.logprobs, inputs.old_logprobs, adv)
    zero = torch.zeros((), dtype=dtype, device=inputs.logprobs.device)

    def clean(x: Tensor | None, detach: bool = True) -> Tensor | None:
        if x is None:
            return None
        x = x.detach() if detach else x
        return torch.where(mask, x.to(dtype), zero)

    return TokenBatch(
        mask=mask, logprobs=clean(inputs.logprobs, detach=False), old=clean(inputs.old_logprobs),
        adv=clean(adv), zero=zero, rollout=clean(inputs.rollout_logprobs), ref=clean(inputs.ref_logprobs),
        entropy=clean(inputs.entropy, detach=False), shadow=clean(inputs.shadow_log_ratio),
    )
