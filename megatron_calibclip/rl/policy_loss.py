"""The policy loss: small terms composed in one place, behind one call.

Why this shape: each part of the loss has one contract and one module, so a new
correction or penalty is added without reading the others (README.md, "Adding a term"):

    inputs  LossInputs + LossConfig -> TokenBatch       loss_inputs.py (checks, padding)
    1. clipped surrogate with [L, H], dual-clip         surrogate.py
    2. rollout correction, by name from a registry      corrections.py, correction_term.py
    3. penalties: KL, entropy bonus                     penalties.py
    4. aggregation to the shard's contribution          aggregation.py
    5. diagnostics: clip / phantom counts, extrema      loss_diagnostics.py, diagnostics.py

Per valid token: loss_t = w * (-min(rA, clip(r, L, H)A)) + beta * KL_t - gamma * H_t.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from megatron_calibclip.rl.aggregation import aggregate
from megatron_calibclip.rl.correction_term import rollout_correction
from megatron_calibclip.rl.diagnostics import finalize_metrics
from megatron_calibclip.rl.loss_config import LossConfig
from megatron_calibclip.rl.loss_diagnostics import clip_counts, ratio_extrema, shadow_counts
from megatron_calibclip.rl.loss_inputs import INPUT_FIELDS, LossInputs, prepare_batch
from megatron_calibclip.rl.penalties import PENALTIES
from megatron_calibclip.rl.surrogate import check_bounds, clipped_surrogate, ppo_clip_bounds

__all__ = ["compute_loss", "policy_loss", "ppo_clip_bounds"]

CONFIG_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LossConfig))


def compute_loss(
    inputs: LossInputs,
    config: LossConfig,
    clip_low: float | Tensor,
    clip_high: float | Tensor,
    *,
    validate: bool = True,
) -> tuple[Tensor, dict[str, Any]]:
    """This shard's loss contribution and its diagnostics.

    clip_low, clip_high: ratio bounds L < H (0.8 / 1.28, not epsilons); float or 0-d tensor.
    validate: run the value checks (NaN at valid tokens, empty mask, bound order); they sync
    the device. Returns (loss, metrics): the fractions (0-d float64, detached),
    metrics["counts"] (summable) and metrics["extrema"] (MIN / MAX); see diagnostics.py.
    """
    batch = prepare_batch(inputs, config, validate=validate)
    if validate:
        check_bounds(clip_low, clip_high)
    sur = clipped_surrogate(batch, clip_low, clip_high, config)
    weights, counts = rollout_correction(batch, config)
    pg = sur.pg if weights is None else sur.pg * weights
    total = pg
    for term in PENALTIES:
        addend, term_counts = term(batch, config)
        counts.update(term_counts)
        if addend is not None:
            total = total + addend
    loss = aggregate(
        total, batch.mask, config.loss_agg_mode, num_tokens=inputs.num_tokens,
        num_sequences=inputs.num_sequences, seq_num_tokens=inputs.seq_num_tokens,
        max_response_length=config.max_response_length, validate=validate,
    )
    counts.update(clip_counts(batch, sur, pg))
    counts.update(shadow_counts(batch, sur, config))
    extrema = ratio_extrema(batch, sur.ratio)
    metrics: dict[str, Any] = dict(finalize_metrics(counts, extrema))
    metrics["loss"] = loss.detach()
    metrics["counts"] = counts
    metrics["extrema"] = extrema
    return loss, metrics


def _from_keywords(
    tensors: tuple[Tensor, ...], config: LossConfig | None, keywords: dict[str, Any]
) -> tuple[LossInputs, LossConfig]:
    """The keyword form's tensors and options, sorted into LossInputs and LossConfig."""
    unknown = sorted(set(keywords) - set(INPUT_FIELDS) - set(CONFIG_FIELDS))
    if unknown:
        raise TypeError(f"policy_loss() got unexpected keyword(s) {unknown}; "
                        f"allowed: the fields of LossInputs and LossConfig")
    options = {k: v for k, v in keywords.items() if k in CONFIG_FIELDS}
    if "correction" in options and options["correction"] is None:
        options["correction"] = "none"
    positional = dict(zip(INPUT_FIELDS, tensors))
    given = {k: v for k, v in keywords.items() if k in INPUT_FIELDS}
    twice = sorted(set(positional) & set(given))
    if len(tensors) > 4 or twice:
        raise TypeError(f"policy_loss() takes 4 tensors (logprobs, old_logprobs, advantages, mask); "
                        f"got {len(tensors)} positional, {twice} also by keyword")
    cfg = dataclasses.replace(config or LossConfig(), **options)
    return LossInputs(**positional, **given), cfg


def policy_loss(
    inputs: LossInputs | Tensor,
    *tensors: Tensor,
    clip_low: float | Tensor,
    clip_high: float | Tensor,
    config: LossConfig | None = None,
    validate: bool = True,
    **keywords: Any,
) -> tuple[Tensor, dict[str, Any]]:
    """Clipped surrogate loss with corrections, penalties and diagnostics (see compute_loss).

    Two ways to call it:
      policy_loss(LossInputs(...), config=LossConfig(...), clip_low=L, clip_high=H)
      policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=L, clip_high=H,
                  rollout_logprobs=..., correction="tis", ...)   # any LossInputs / LossConfig field
    The second is the keyword form (quick use, tests); it builds the same two records
    (``correction=None`` means "none"; keywords override ``config``).
    """
    if isinstance(inputs, LossInputs):
        if tensors or keywords:
            raise TypeError("policy_loss(LossInputs, ...) takes no further tensors or keywords: "
                            f"put them in the LossInputs / LossConfig (got {sorted(keywords)})")
        return compute_loss(inputs, config or LossConfig(), clip_low, clip_high, validate=validate)
    records = _from_keywords((inputs,) + tensors, config, keywords)
    return compute_loss(*records, clip_low, clip_high, validate=validate)
