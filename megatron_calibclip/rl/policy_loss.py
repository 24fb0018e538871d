"""PPO-style clipped policy-gradient loss with independent [L, H] ratio bounds.

Why bounds and not epsilons: Calibrated Clipping replaces [1 - eps_low, 1 + eps_high]
with a calibrated [L, H] that is neither symmetric nor tied to 1, and it changes between
steps; so the loss takes the ratio bounds themselves, as floats or 0-d tensors.

Per valid token, with r = exp(logp - logp_old) and advantage A:
    loss_t = -min(r A, clip(r, L, H) A)
so the gradient w.r.t. logp is exactly 0 where (A<0 and r<L) or (A>0 and r>H), and equals
the unclipped -A r elsewhere. Dual-clip (Ye et al. 2020) additionally bounds the loss of
negative-advantage tokens: for A<0 the objective is max(min(rA, clip(r)A), cA), i.e.
loss_t = min(loss_t, -c A), which also zeroes the gradient where r > c.
Then, optionally: loss_t *= w (TIS/MIS weight, detached), + beta * KL_t, - gamma * H_t,
and the aggregation mode reduces loss_t to a scalar (see aggregation.py).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megatron_calibclip.rl import _validation as V
from megatron_calibclip.rl.aggregation import AGG_MODES, LossAggMode, aggregate
from megatron_calibclip.rl.corrections import (
    CORRECTION_MODES,
    CorrectionMode,
    SeqWeight,
    correction_weights,
    rollout_log_weight,
)
from megatron_calibclip.rl.diagnostics import count, finalize_metrics
from megatron_calibclip.rl.kl import KL_TYPES, KLType, kl_penalty


def ppo_clip_bounds(eps_low: float, eps_high: float) -> tuple[float, float]:
    """The host algorithm's bounds: (1 - eps_low, 1 + eps_high); GRPO 0.2/0.2, DAPO 0.2/0.28."""
    return 1.0 - eps_low, 1.0 + eps_high


def _check_bounds(clip_low: float | Tensor, clip_high: float | Tensor) -> None:
    lo = V.as_float("clip_low", clip_low)
    hi = V.as_float("clip_high", clip_high)
    if math.isnan(lo) or math.isinf(lo) or lo < 0:
        raise ValueError(f"clip_low must be a finite ratio >= 0 (e.g. 0.8), got {lo}")
    if math.isnan(hi):
        raise ValueError(f"clip_high must be a ratio > clip_low (e.g. 1.28), got {hi}")
    if lo >= hi:
        raise ValueError(
            f"clip_low={lo} must be < clip_high={hi} (they are ratio bounds such as 0.8 / 1.28, "
            "not epsilons)"
        )


def _expand_advantages(advantages: Tensor, shape: torch.Size) -> Tensor:
    V.check_tensor("advantages", advantages)
    if advantages.shape == shape:
        return advantages
    if len(shape) == 2 and advantages.shape == shape[:1]:
        return advantages.unsqueeze(-1).expand(shape)
    allowed = f"{tuple(shape)}" + (f" or {tuple(shape[:1])}" if len(shape) == 2 else "")
    raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {allowed}")


def _bound(value: float | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach().to(dtype=dtype, device=device)
    return torch.tensor(float(value), dtype=dtype, device=device)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | Tensor,
    clip_high: float | Tensor,
    dual_clip: bool = False,
    dual_clip_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    seq_num_tokens: Tensor | None = None,
    max_response_length: int | None = None,
    rollout_logprobs: Tensor | None = None,
    correction: CorrectionMode | None = None,
    correction_cap: float = 2.0,
    mis_seq_weight: SeqWeight = "product",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: KLType = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    shadow_log_ratio: Tensor | None = None,
    shadow_eps_low: float | None = None,
    shadow_eps_high: float | None = None,
    log_ratio_clamp: float = 20.0,
    validate: bool = True,
) -> tuple[Tensor, dict[str, Any]]:
    """Clipped surrogate loss and its diagnostics.

    Tensors are [batch, seq] (or [seq]); ``mask`` is bool of the same shape; ``advantages``
    is per token or per sequence ([batch], broadcast over seq). Gradients flow only into
    ``logprobs`` (and ``entropy`` when entropy_coef != 0); everything else is detached.

    clip_low, clip_high: ratio bounds L < H (0.8 / 1.28, not epsilons); float or 0-d tensor.
    dual_clip, dual_clip_c: cap the loss of A<0 tokens at -c*A (c > 1, default 3).
    loss_agg_mode, num_tokens, num_sequences, seq_num_tokens, max_response_length:
        see aggregation.aggregate; pass the global normaliser under data parallelism.
    rollout_logprobs: log-probs of the rollout engine (mu). Enables the multiplicative
        probability-error metric and, with ``correction``, the IS weight w = pi_old / mu.
    correction: None, "tis" (min(w, C)), "mis-token" or "mis-seq" (w * 1[w <= C]); C =
        correction_cap; mis_seq_weight = "product" | "geometric" sequence weight.
    ref_logprobs, kl_coef, kl_type: penalty kl_coef * KL_t (k1/k2/k3). ref_logprobs without
        kl_coef only logs kl_mean.
    entropy, entropy_coef: bonus -entropy_coef * H_t (entropy per token, with grad).
    shadow_log_ratio: BF16 (or fp32) shadow log r for the same tokens; with shadow_eps_low
        it gives the phantom-clip fraction P(r < L and r_shadow >= 1 - eps_low | A<0) and
        the shadow clip fractions (upper one only if shadow_eps_high is given).
    log_ratio_clamp: |log r| is clamped here before exp (overflow guard; it zeroes the
        gradient beyond, where r is far outside any sane bounds anyway).
    validate: run the value checks (NaN, empty mask, bound order); they sync the device.

    Returns (loss, metrics): metrics holds the derived fractions (0-d float64 tensors,
    detached), metrics["counts"] the summable numerators/denominators and
    metrics["extrema"] the ratio min/max (reduce with MIN/MAX); see diagnostics.py.
    """
    # ---- shapes and options -------------------------------------------------------------
    V.check_token_shape("logprobs", logprobs)
    shape = logprobs.shape
    V.check_same_shape("old_logprobs", old_logprobs, shape, "logprobs")
    V.check_mask(mask, shape)
    adv = _expand_advantages(advantages, shape)
    optional = {
        "rollout_logprobs": rollout_logprobs,
        "ref_logprobs": ref_logprobs,
        "entropy": entropy,
        "shadow_log_ratio": shadow_log_ratio,
    }
    for name, t in optional.items():
        if t is not None:
            V.check_same_shape(name, t, shape, "logprobs")
    V.check_choice("loss_agg_mode", loss_agg_mode, AGG_MODES)
    V.check_choice("kl_type", kl_type, KL_TYPES)
    if correction is not None:
        V.check_choice("correction", correction, CORRECTION_MODES)
        if rollout_logprobs is None:
            raise ValueError(f"correction={correction!r} needs rollout_logprobs")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy")
    if shadow_log_ratio is not None and shadow_eps_low is None:
        raise ValueError("shadow_log_ratio needs shadow_eps_low (the host eps_low, e.g. 0.2)")
    if shadow_eps_low is not None and not 0.0 < float(shadow_eps_low) < 1.0:
        raise ValueError(f"shadow_eps_low must be an epsilon in (0, 1) such as 0.2, got {shadow_eps_low}")
    if shadow_eps_high is not None and not float(shadow_eps_high) > 0.0:
        raise ValueError(f"shadow_eps_high must be an epsilon > 0 such as 0.28, got {shadow_eps_high}")
    if dual_clip:
        V.check_positive("dual_clip_c", float(dual_clip_c))
        if float(dual_clip_c) <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (e.g. 3), got {dual_clip_c}")
    if validate:
        _check_bounds(clip_low, clip_high)
        V.check_nonempty_mask(mask)
        for name, t in {"logprobs": logprobs, "old_logprobs": old_logprobs, **optional}.items():
            if t is not None:
                V.check_finite_where(name, t, mask)
        if advantages.shape == shape:
            V.check_finite_where("advantages", advantages, mask)
        else:  # per-sequence: only sequences with a valid token matter
            V.check_finite_where("advantages", advantages, mask.any(dim=-1))

    # ---- ratio and clipped surrogate ----------------------------------------------------
    dtype = V.compute_dtype(logprobs, old_logprobs, adv)
    dev = logprobs.device
    zero = torch.zeros((), dtype=dtype, device=dev)

    def clean(x: Tensor, detach: bool = True) -> Tensor:
        x = x.detach() if detach else x
        return torch.where(mask, x.to(dtype), zero)

    lp = clean(logprobs, detach=False)
    old = clean(old_logprobs)
    A = clean(adv)
    log_ratio = torch.clamp(lp - old, min=-log_ratio_clamp, max=log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    L = _bound(clip_low, dtype, dev)
    H = _bound(clip_high, dtype, dev)

    neg = mask & (A < 0)
    pos = mask & (A > 0)
    clip_lower = neg & (ratio < L)
    clip_upper = pos & (ratio > H)
    # where() instead of min(): same value as -min(rA, clip(r)A), but the zero-gradient set
    # is explicit and no 0 * inf appears in backward.
    r_eff = torch.where(clip_lower, L, torch.where(clip_upper, H, ratio))
    dual = torch.zeros_like(mask)
    if dual_clip:
        c = torch.tensor(float(dual_clip_c), dtype=dtype, device=dev)
        dual = neg & (r_eff > c)
        r_eff = torch.where(dual, c, r_eff)
    pg = -A * r_eff

    # ---- rollout correction, KL, entropy --------------------------------------------------
    counts: dict[str, Tensor] = {}
    if rollout_logprobs is not None:
        log_w = rollout_log_weight(old, clean(rollout_logprobs), mask)
        counts["mult_prob_error_sum"] = count(torch.where(mask, torch.exp(log_w.abs()), zero))
        if correction is not None:
            weights, affected = correction_weights(
                correction, log_w, mask, cap=correction_cap, seq_weight=mis_seq_weight
            )
            pg = pg * weights
            counts["is_weight_sum"] = count(weights)
            if correction == "tis":
                counts["tis_capped_tokens"] = count(affected)
            else:
                counts["mis_rejected_tokens"] = count(affected)
                if correction == "mis-seq":
                    counts["mis_rejected_seqs"] = count(affected.reshape(-1, shape[-1]).any(dim=-1))
    total = pg
    if ref_logprobs is not None:
        kl = torch.where(mask, kl_penalty(lp, clean(ref_logprobs), kl_type), zero)
        counts["kl_sum"] = count(kl)
        if kl_coef != 0.0:
            total = total + kl_coef * kl
    if entropy is not None:
        ent = clean(entropy, detach=False)
        counts["entropy_sum"] = count(ent)
        if entropy_coef != 0.0:
            total = total - entropy_coef * ent

    loss = aggregate(
        total,
        mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        seq_num_tokens=seq_num_tokens,
        max_response_length=max_response_length,
        validate=validate,
    )

    # ---- diagnostics -----------------------------------------------------------------------
    m2 = mask.reshape(-1, shape[-1])
    counts.update(
        tokens=count(mask),
        seqs=count(m2.any(dim=-1)),
        neg_tokens=count(neg),
        pos_tokens=count(pos),
        clip_lower_neg=count(clip_lower),
        clip_upper_pos=count(clip_upper),
        clipped_tokens=count(clip_lower | clip_upper),
        ratio_sum=count(torch.where(mask, ratio, zero)),
        pg_loss_sum=count(torch.where(mask, pg, zero)),
    )
    if dual_clip:
        counts["dual_clip_neg"] = count(dual)
    if shadow_log_ratio is not None:
        r16 = torch.exp(clean(shadow_log_ratio).to(torch.float64))
        lo16 = 1.0 - float(shadow_eps_low)
        counts["phantom_clip_neg"] = count(clip_lower & (r16 >= lo16))
        counts["shadow_clip_lower_neg"] = count(neg & (r16 < lo16))
        if shadow_eps_high is not None:
            counts["shadow_clip_upper_pos"] = count(pos & (r16 > 1.0 + float(shadow_eps_high)))
    r_det = ratio.detach().to(torch.float64)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=dev)
    extrema = {  # where() instead of boolean indexing: no device sync
        "ratio_min": torch.where(mask, r_det, inf).min(),
        "ratio_max": torch.where(mask, r_det, -inf).max(),
    }
    metrics: dict[str, Any] = dict(finalize_metrics(counts, extrema))
    metrics["loss"] = loss.detach()
    metrics["counts"] = counts
    metrics["extrema"] = extrema
    return loss, metrics
