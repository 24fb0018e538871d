"""Clip/correction diagnostics as summable counts, and the fractions derived from them.

Why counts and not fractions: a fraction averaged over micro-batches or DP ranks is
wrong whenever the shards hold different numbers of tokens (and the phantom-clip fraction
is conditioned on A<0, whose count varies a lot). So every metric is numerator /
denominator, and both are returned in ``counts``:

    counts_total = merge_counts([counts of every micro-batch on every rank])
    # (or: stack the values in COUNT order, all_reduce(SUM) over the DP group)
    metrics      = finalize_metrics(counts_total, extrema_total)

gives exactly the metrics of the whole batch. ``extrema`` (ratio min / max) are not sums:
reduce them with MIN / MAX (``merge_extrema``). All values are detached float64 0-d
tensors on the input's device (float64 so token counts stay exact past 2**24).

Fractions whose denominator is 0 (e.g. no A<0 token) are reported as 0.0.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import Tensor

from megatron_calibclip.parallel.devices import device_of

# numerator key -> denominator key, for every derived metric
FRACTIONS: dict[str, tuple[str, str]] = {
    "clipfrac_lower": ("clip_lower_neg", "neg_tokens"),  # P(r < L | A<0): gradient dropped
    "clipfrac_upper": ("clip_upper_pos", "pos_tokens"),  # P(r > H | A>0): gradient dropped
    "clipfrac": ("clipped_tokens", "tokens"),  # both sides, over all valid tokens
    "dual_clipfrac": ("dual_clip_neg", "neg_tokens"),  # P(dual-clip active | A<0)
    "ratio_mean": ("ratio_sum", "tokens"),
    "pg_loss_token_mean": ("pg_loss_sum", "tokens"),  # unweighted by aggregation mode
    "mult_prob_error": ("mult_prob_error_sum", "tokens"),  # mean exp|logp_rollout - logp_old|
    "is_weight_mean": ("is_weight_sum", "tokens"),
    "tis_clipfrac": ("tis_capped_tokens", "tokens"),  # P(w > C)
    "mis_maskfrac": ("mis_rejected_tokens", "tokens"),  # tokens given weight 0
    "mis_maskfrac_low": ("mis_rejected_low_tokens", "tokens"),  # of them w < C_low (two-sided)
    "mis_seq_maskfrac": ("mis_rejected_seqs", "seqs"),  # sequences dropped (mis-seq)
    "kl_mean": ("kl_sum", "tokens"),
    "entropy_mean": ("entropy_sum", "tokens"),
    # P(r_fp8 < L and r_bf16 >= 1 - eps_low | A<0): clipped only because of FP8 noise
    "phantom_clipfrac": ("phantom_clip_neg", "neg_tokens"),
    "shadow_clipfrac_lower": ("shadow_clip_lower_neg", "neg_tokens"),
    "shadow_clipfrac_upper": ("shadow_clip_upper_pos", "pos_tokens"),
}
EXTREMA_REDUCE: dict[str, str] = {"ratio_min": "min", "ratio_max": "max"}


def count(x: Tensor) -> Tensor:
    """Detached float64 0-d sum (a bool mask counts its True entries)."""
    return x.detach().sum(dtype=torch.float64)


def merge_counts(all_counts: Iterable[Mapping[str, Tensor | float]]) -> dict[str, Tensor]:
    """Sum count dicts of several micro-batches / ranks (keys must agree)."""
    out: dict[str, Tensor] = {}
    keys: set[str] | None = None
    for c in all_counts:
        if keys is None:
            keys = set(c)
        elif set(c) != keys:
            raise ValueError(f"all_counts: key sets differ: {sorted(keys)} vs {sorted(c)}")
        for k, v in c.items():
            v = torch.as_tensor(v, dtype=torch.float64, device=device_of(v))
            out[k] = out[k] + v.to(out[k].device) if k in out else v.clone()
    if keys is None:
        raise ValueError("all_counts is empty")
    return out


def merge_extrema(all_extrema: Iterable[Mapping[str, Tensor | float]]) -> dict[str, Tensor]:
    """Combine ratio_min / ratio_max across shards with MIN / MAX."""
    out: dict[str, Tensor] = {}
    for e in all_extrema:
        for k, v in e.items():
            v = torch.as_tensor(v, dtype=torch.float64, device=device_of(v))
            if k not in EXTREMA_REDUCE:
                raise ValueError(f"all_extrema: unknown key {k!r}; known: {sorted(EXTREMA_REDUCE)}")
            if k not in out:
                out[k] = v.clone()
            else:
                op = torch.minimum if EXTREMA_REDUCE[k] == "min" else torch.maximum
                out[k] = op(out[k], v.to(out[k].device))
    return out


def finalize_metrics(
    counts: Mapping[str, Tensor | float], extrema: Mapping[str, Tensor | float] | None = None
) -> dict[str, Tensor]:
    """Fractions/means from (summed) counts; only the metrics whose counts are present."""
    out: dict[str, Tensor] = {}
    for name, (num, den) in FRACTIONS.items():
        if num in counts and den in counts:
            n = torch.as_tensor(counts[num], dtype=torch.float64, device=device_of(counts[num]))
            d = torch.as_tensor(counts[den], dtype=torch.float64, device=n.device)
            out[name] = torch.where(d > 0, n / d.clamp(min=1e-300), torch.zeros_like(n))
    for k, v in (extrema or {}).items():
        out[k] = torch.as_tensor(v, dtype=torch.float64, device=device_of(v))
    return out
