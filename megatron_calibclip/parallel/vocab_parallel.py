"""Per-token log-probs and full-vocabulary entropy of vocab-sharded logits, without gathering.

With tensor parallelism the output layer leaves each rank with a slice [.., V/tp] of the
logits. We reduce three numbers per token instead of gathering V: the max (all-reduce MAX),
then sum exp(x - m), sum exp(x - m) * x and the target logit (one all-reduce SUM). All in
fp32. Columns at or beyond the true vocabulary size (TP padding) are excluded: they are
not tokens, and counting them would bias the entropy.

The backward pass is local (no communication): with p = softmax(x),
d logp_t / dx_j = 1[j = t] - p_j and d H / dx_j = -p_j (x_j - E_p[x]).

Why not megatron's vocab_parallel_cross_entropy: it gives only the loss (no entropy), and it
overwrites fp32 input logits in place.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _group_size(group) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, true_vocab_size, group):
        x = logits.float()
        local_v = x.shape[-1]
        col = torch.arange(vocab_start, vocab_start + local_v, device=x.device)
        valid_col = col < true_vocab_size  # TP padding columns are not tokens
        all_valid = bool(valid_col.all())  # the common case: no mask passes over [.., V]
        if not all_valid:
            x = x.masked_fill(~valid_col, float("-inf"))
        world = _group_size(group)

        m = x.max(dim=-1).values
        if world > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        # work with shifted logits x - m (<= 0): the max cancels exactly, which keeps the
        # entropy log Z - E[x] free of the cancellation error of large logits
        shifted = x - m.unsqueeze(-1)
        if all_valid:
            e = torch.exp(shifted)
        else:
            shifted = torch.where(valid_col, shifted, 0.0)
            e = torch.where(valid_col, torch.exp(shifted), 0.0)
        in_shard = (targets >= vocab_start) & (targets < vocab_start + local_v)
        local_idx = (targets - vocab_start).clamp(0, local_v - 1)
        target_logit = torch.gather(shifted, -1, local_idx.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(in_shard, target_logit, torch.zeros_like(target_logit))
        stats = torch.stack([e.sum(-1), (e * shifted).sum(-1), target_logit], dim=0)
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_e, sum_ex, t_logit = stats[0], stats[1], stats[2]
        log_sum_e = torch.log(sum_e)
        mean_shifted = sum_ex / sum_e
        logp = t_logit - log_sum_e
        entropy = log_sum_e - mean_shifted
        log_z = m + log_sum_e
        mean_x = m + mean_shifted
        ctx.save_for_backward(x, log_z, mean_x, local_idx, in_shard, valid_col)
        ctx.input_dtype, ctx.all_valid = logits.dtype, all_valid
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        x, log_z, mean_x, local_idx, in_shard, valid_col = ctx.saved_tensors
        p = torch.exp(x - log_z.unsqueeze(-1))  # 0 on padding columns
        grad = None  # 0 - a - b, as rsub (no zero tensor), same rounding and signs of zero
        if grad_entropy is not None:
            centered = x - mean_x.unsqueeze(-1)
            if not ctx.all_valid:
                centered = torch.where(valid_col, centered, 0.0)
            grad = torch.rsub(grad_entropy.unsqueeze(-1) * p * centered, 0.0)
        if grad_logp is not None:
            term = grad_logp.unsqueeze(-1) * p
            grad = torch.rsub(term, 0.0) if grad is None else grad - term
            onehot = torch.zeros_like(x)
            onehot.scatter_(-1, local_idx.unsqueeze(-1), in_shard.unsqueeze(-1).to(x.dtype))
            grad = grad + grad_logp.unsqueeze(-1) * onehot
        if grad is None:
            grad = torch.zeros_like(x)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    true_vocab_size: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy of the full distribution, per token, in fp32.

    logits: [..., V_local], this rank's contiguous vocabulary slice (rank r of the group
    holds columns [r * V_local, (r + 1) * V_local)) unless `vocab_start` says otherwise.
    targets: [...] global token ids. true_vocab_size: columns >= it are TP padding.
    group: the tensor-parallel group (None: the logits are the whole vocabulary).
    Differentiable w.r.t. logits.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match logits batch shape "
            f"{tuple(logits.shape[:-1])}"
        )
    world = _group_size(group)
    local_v = logits.shape[-1]
    if vocab_start is None:
        vocab_start = (dist.get_rank(group) if world > 1 else 0) * local_v
    full_v = local_v * world
    true_vocab_size = full_v if true_vocab_size is None else true_vocab_size
    if not 0 < true_vocab_size <= full_v:
        raise ValueError(f"true_vocab_size {true_vocab_size} must be in (0, {full_v}]")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= true_vocab_size):
        raise ValueError(
            f"target ids must be in [0, {true_vocab_size}); got range "
            f"[{int(targets.min())}, {int(targets.max())}] (mask ignored positions with a "
            f"valid id such as 0)"
        )
    return _VocabParallelLogprobEntropy.apply(
        logits, targets.long(), vocab_start, true_vocab_size, group
    )


def dense_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, true_vocab_size: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process reference: log_softmax over the (unpadded) vocabulary, in fp32."""
    x = logits.float()
    if true_vocab_size is not None:
        x = x[..., :true_vocab_size]
    logp_all = torch.log_softmax(x, dim=-1)
    logp = torch.gather(logp_all, -1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
