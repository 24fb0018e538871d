"""Rollout/trainer mismatch corrections: importance weights, chosen by name from a registry.

Why: the rollout engine (FP8 kernels, another recipe) samples from mu, while the trainer
computes pi_old; the PPO ratio pi_theta/pi_old does not see that gap. Re-weighting each
token by w = pi_old/mu makes the gradient an estimate under the right distribution.
Raw weights have unbounded variance, so
  TIS (truncated IS):  weight = min(w, C)              - bias for variance, nothing dropped
  MIS (masked IS):     weight = w * 1[w <= C]          - drops outliers instead of biasing them
MIS can act per token or per sequence (a sequence whose weight W exceeds C is dropped
whole; its kept tokens are all weighted by W, the sequence-level estimator).
Two-sided token MIS (icepop-style): weight = w * 1[C_low <= w <= C] - also drops tokens
the trainer finds much less likely than the rollout engine did.
Weights are detached: they rescale the gradient, they are not optimised.

Every correction has one contract, ``(log_w, mask, config) -> (weights, counts)``:
log_w = log pi_old - log mu (detached, 0 under padding), weights the per-token factor of
the surrogate (None: no re-weighting), counts its summable numerators (their fractions
are declared in diagnostics.FRACTIONS). A new correction is one function under
``@register_correction("name")``; LossConfig accepts the name from then on, and the loss
applies it through correction_term.py.

Note: corrections fix the rollout-vs-trainer ratio; they do not touch the trainer's own
PPO ratio noise that Calibrated Clipping targets (see the SPEC).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Protocol

import torch
from torch import Tensor

from megatron_calibclip.config import ConfigError
from megatron_calibclip.rl import _validation as V
from megatron_calibclip.rl.diagnostics import count

# The built-in corrections (registered below); the YAML section accepts these names.
CorrectionName = Literal["none", "tis", "mis-token", "mis-seq", "mis-token-two-sided"]
SeqWeight = Literal["product", "geometric"]
SEQ_WEIGHTS: tuple[str, ...] = ("product", "geometric")


class CorrectionOptions(Protocol):
    """The options a correction reads; loss_config.LossConfig has them. A protocol, not
    LossConfig itself, because LossConfig checks its `correction` against this registry: the
    registry sits below it and does not import it."""

    @property
    def correction_cap(self) -> float: ...
    @property
    def correction_cap_low(self) -> float: ...
    @property
    def mis_seq_weight(self) -> SeqWeight: ...


CorrectionFn = Callable[[Tensor, Tensor, CorrectionOptions], tuple[Optional[Tensor], dict[str, Tensor]]]


@dataclass(frozen=True)
class Correction:
    fn: CorrectionFn  # (log_w, mask, config) -> (weights or None, counts)
    check: Callable[[CorrectionOptions], None] | None = None  # raises ConfigError on a bad option


CORRECTIONS: dict[str, Correction] = {}


def register_correction(
    name: str, *, check: Callable[[CorrectionOptions], None] | None = None
) -> Callable[[CorrectionFn], CorrectionFn]:
    """Register ``fn`` under ``name``; ``check(config)`` validates the options it reads."""
    def add(fn: CorrectionFn) -> CorrectionFn:
        if name in CORRECTIONS:
            raise ValueError(f"correction {name!r} is already registered")
        CORRECTIONS[name] = Correction(fn, check)
        return fn
    return add


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
        V.check_choice("seq_weight", seq_weight, SEQ_WEIGHTS)
        lw = torch.where(mask, log_w, zero)
        seq_log = lw.sum(dim=-1, keepdim=True)
        if seq_weight == "geometric":
            seq_log = seq_log / mask.sum(dim=-1, keepdim=True).clamp(min=1).to(lw.dtype)
        w = torch.exp(seq_log).expand_as(log_w)
        rejected = mask & (w > cap)
    weights = torch.where(mask & ~rejected, w, zero)
    return weights, rejected


@register_correction("none")
def no_correction(log_w: Tensor, mask: Tensor, config: CorrectionOptions) -> tuple[None, dict[str, Tensor]]:
    """No re-weighting (the probability-error metric is still logged with rollout log-probs)."""
    return None, {}


@register_correction("tis")
def tis_correction(log_w: Tensor, mask: Tensor, config: CorrectionOptions) -> tuple[Tensor, dict[str, Tensor]]:
    weights, capped = tis_weights(log_w, mask, cap=config.correction_cap)
    return weights, {"tis_capped_tokens": count(capped)}


@register_correction("mis-token")
def mis_token_correction(log_w: Tensor, mask: Tensor, config: CorrectionOptions) -> tuple[Tensor, dict[str, Tensor]]:
    weights, rejected = mis_weights(log_w, mask, cap=config.correction_cap, level="token")
    return weights, {"mis_rejected_tokens": count(rejected)}


@register_correction("mis-seq")
def mis_seq_correction(log_w: Tensor, mask: Tensor, config: CorrectionOptions) -> tuple[Tensor, dict[str, Tensor]]:
    weights, rejected = mis_weights(
        log_w, mask, cap=config.correction_cap, level="sequence", seq_weight=config.mis_seq_weight
    )
    seqs = rejected.reshape(-1, mask.shape[-1]).any(dim=-1)
    return weights, {"mis_rejected_tokens": count(rejected), "mis_rejected_seqs": count(seqs)}


def _check_band(config: CorrectionOptions) -> None:
    low, high = config.correction_cap_low, config.correction_cap
    if not 0.0 < low < high:
        raise ConfigError(
            f"correction_cap_low: {low!r} is invalid; it must be in (0, correction_cap={high!r}) "
            "for correction 'mis-token-two-sided'"
        )


@register_correction("mis-token-two-sided", check=_check_band)
def mis_token_two_sided_correction(
    log_w: Tensor, mask: Tensor, config: CorrectionOptions
) -> tuple[Tensor, dict[str, Tensor]]:
    """icepop-style: weight w where C_low <= w <= C, else 0 (the token leaves the gradient)."""
    w = torch.exp(log_w.detach())
    low = mask & (w < config.correction_cap_low)
    rejected = low | (mask & (w > config.correction_cap))
    weights = torch.where(mask & ~rejected, w, torch.zeros_like(w))
    return weights, {"mis_rejected_tokens": count(rejected), "mis_rejected_low_tokens": count(low)}


CORRECTION_MODES: tuple[str, ...] = tuple(name for name in CORRECTIONS if name != "none")  # built-in
