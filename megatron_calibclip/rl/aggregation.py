"""Reduce a per-token loss to a scalar: the three aggregation modes of GRPO-family papers.

Why it matters: the choice changes the objective, not just its scale. Per-sequence means
(GRPO) give every answer equal weight, so tokens of long answers count less; DAPO's
token-mean gives every token equal weight; Dr. GRPO divides each sequence's token sum by
a constant so that neither length nor group statistics bias the gradient.

Modes (m = mask, x = per-token values, T_max = constant budget):
  token-mean               sum_{i,t} m x / N_tok
  seq-mean-token-mean      (1/N_seq) sum_i [ sum_t m x / n_i ]
  seq-mean-token-sum-norm  (1/N_seq) sum_i [ sum_t m x / T_max ]

Data-parallel / micro-batch contract: the returned value is this shard's *contribution*.
Pass the normaliser of the whole optimizer step (N_tok for token-mean, N_seq for the
seq modes, summed over all DP ranks and micro-batches); then the sum of the returned
values over all shards equals the loss of the full batch exactly, and so do the summed
gradients. Without it the local count is used, which is only right for one shard.
A sequence split across context-parallel ranks needs its full token count n_i:
pass ``seq_num_tokens``.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatron_calibclip.rl import _validation as V

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of values at mask positions; NaN/inf under padding never leak (where, not *)."""
    x = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over mask positions (0 where a row has no valid position)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def _as_2d(x: Tensor) -> Tensor:
    return x.unsqueeze(0) if x.dim() == 1 else x


def _check_count(name: str, value: float | Tensor, local: int, what: str) -> None:
    v = V.as_float(name, value)
    V.check_positive(name, v)
    if v < local:
        raise ValueError(
            f"{name}={v} is smaller than the {local} {what} of this shard; it must be the "
            "count over all data-parallel ranks and micro-batches"
        )


def _check_args(
    values: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: float | Tensor | None,
    num_sequences: float | Tensor | None,
    seq_num_tokens: Tensor | None,
    max_response_length: int | None,
) -> None:
    """Each normaliser belongs to one mode: passing another mode's one is a caller bug."""
    V.check_choice("mode", mode, AGG_MODES)
    V.check_token_shape("values", values)
    V.check_mask(mask, values.shape)
    if mode != "token-mean" and num_tokens is not None:
        raise ValueError(f"num_tokens is only used by mode 'token-mean' (mode={mode!r}); use num_sequences")
    if mode == "token-mean" and num_sequences is not None:
        raise ValueError("num_sequences is not used by mode 'token-mean'; use num_tokens")
    if mode != "seq-mean-token-mean" and seq_num_tokens is not None:
        raise ValueError(f"seq_num_tokens is only used by mode 'seq-mean-token-mean' (mode={mode!r})")
    if mode != "seq-mean-token-sum-norm" and max_response_length is not None:
        raise ValueError(
            f"max_response_length is only used by mode 'seq-mean-token-sum-norm' (mode={mode!r})"
        )


def _denominator(
    name: str, given: float | Tensor | None, counted: Tensor, what: str, like: Tensor, validate: bool
) -> Tensor:
    """The step's normaliser if given (never below this shard's count), else the local count."""
    if given is None:
        return counted.sum().to(like.dtype)
    if validate:
        _check_count(name, given, int(counted.sum()), what)
    return torch.as_tensor(given, dtype=like.dtype, device=like.device)


def _per_sequence(
    values: Tensor,
    mask: Tensor,
    mode: str,
    seq_num_tokens: Tensor | None,
    max_response_length: int | None,
    validate: bool,
) -> tuple[Tensor, Tensor]:
    """(per-sequence value, has-tokens) of the two seq modes, before the mean over sequences."""
    x2, m2 = _as_2d(values), _as_2d(mask)
    seq_sum = masked_sum(x2, m2, dim=-1)
    local_counts = m2.sum(dim=-1)
    has_tokens = local_counts > 0
    if mode == "seq-mean-token-mean":
        if seq_num_tokens is None:
            n_i = local_counts
        else:
            seq_num_tokens = V.check_same_shape(
                "seq_num_tokens", seq_num_tokens, local_counts.shape, "values.shape[:-1] (or (1,) for 1-D)"
            )
            if validate and bool((seq_num_tokens < local_counts).any()):
                raise ValueError("seq_num_tokens is smaller than the local valid-token count of a sequence")
            n_i = seq_num_tokens
        per_seq = seq_sum / n_i.to(values.dtype).clamp(min=1)
    else:
        t_max = values.shape[-1] if max_response_length is None else max_response_length
        if validate:
            if isinstance(t_max, bool) or not isinstance(t_max, int) or t_max <= 0:
                raise ValueError(f"max_response_length must be a positive int, got {t_max!r}")
            if t_max < int(local_counts.max()):
                raise ValueError(
                    f"max_response_length={t_max} is smaller than a sequence's valid-token count "
                    f"({int(local_counts.max())})"
                )
        per_seq = seq_sum / float(t_max)
    return torch.where(has_tokens, per_seq, torch.zeros_like(per_seq)), has_tokens


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: LossAggMode = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    seq_num_tokens: Tensor | None = None,
    max_response_length: int | None = None,
    validate: bool = True,
) -> Tensor:
    """Aggregate per-token ``values`` [batch, seq] (or [seq] = one sequence) to a scalar.

    num_tokens: global valid-token count (token-mean only).
    num_sequences: global count of sequences with >= 1 valid token (seq modes only).
    seq_num_tokens: [batch] full valid-token count of each sequence (seq-mean-token-mean
        only; needed when context parallelism splits a sequence).
    max_response_length: the constant T_max of seq-mean-token-sum-norm; defaults to the
        padded length ``values.shape[-1]``, which is only constant across micro-batches
        if they are all padded to the same length, so pass the generation budget.
    """
    _check_args(values, mask, mode, num_tokens, num_sequences, seq_num_tokens, max_response_length)
    if validate:
        V.check_nonempty_mask(mask)
        V.check_finite_where("values", values, mask)
    if mode == "token-mean":
        return masked_sum(values, mask) / _denominator("num_tokens", num_tokens, mask, "valid tokens",
                                                       values, validate)
    per_seq, has_tokens = _per_sequence(values, mask, mode, seq_num_tokens, max_response_length, validate)
    return per_seq.sum() / _denominator("num_sequences", num_sequences, has_tokens,
                                        "sequences with valid tokens", values, validate)
