"""Short supervised warm-up: teach a from-scratch policy the answer format before RL.

A randomly initialised tiny model almost never samples a correct answer, so GRPO would see
only zero-variance groups and learn nothing. A few hundred cross-entropy steps on
(prompt, reference answer + EOS) pairs give it a non-trivial starting accuracy; RL then
has to raise it. Uses the same model, DDP, optimizer and schedule as the RL update.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_calibclip.fp8.weight_cache import invalidate_weight_caches
from megatron_calibclip.parallel.devices import collective_device
from megatron_calibclip.trainer.components import Components
from megatron_calibclip.trainer.config import WarmupConfig
from megatron_calibclip.trainer.forward import run_schedule, split_micro_batches, token_logprobs


def _set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def supervised_batch(c: Components, n: int):
    """Left-padded prompts followed by answer + EOS, and the mask of the answer targets."""
    items = c.dataset.next_batch(n)[c.dp_rank::c.dp_size]
    rows = []
    for it in items:
        answer = c.tokenizer.encode(" " + it.record.answer)
        if c.tokenizer.bos_id is not None and answer and answer[0] == c.tokenizer.bos_id:
            answer = answer[1:]
        rows.append((list(it.ids), answer + [c.tokenizer.eos_id]))
    p = max(len(a) for a, _ in rows)
    r = max(len(b) for _, b in rows)
    pad, dev = c.tokenizer.pad_id, c.device
    tokens = torch.full((len(rows), p + r), pad, dtype=torch.long, device=dev)
    key_pad = torch.zeros(len(rows), p + r, dtype=torch.bool, device=dev)
    mask = torch.zeros(len(rows), p + r - 1, dtype=torch.bool, device=dev)
    for i, (prompt, ans) in enumerate(rows):
        tokens[i, p - len(prompt): p] = torch.tensor(prompt, device=dev)
        tokens[i, p: p + len(ans)] = torch.tensor(ans, device=dev)
        key_pad[i, : p - len(prompt)] = True
        mask[i, p - 1: p - 1 + len(ans)] = True
    return tokens, key_pad[:, None, None, :], mask


def run_warmup(c: Components, cfg: WarmupConfig, log=None) -> list[float]:
    """`cfg.steps` cross-entropy steps on reference answers; returns the loss per step."""
    if cfg.steps <= 0:
        return []
    base_lrs = [g["lr"] for g in c.optimizer.param_groups]
    _set_lr(c.optimizer, cfg.lr)
    vocab = c.model_cfg.vocab_size
    losses = []
    try:
        for step in range(cfg.steps):
            tokens, attn, mask = supervised_batch(c, cfg.prompts_per_step)
            total = torch.tensor([float(mask.sum())], device=collective_device(c.dp_group))
            dist.all_reduce(total, group=c.dp_group)
            mbs, _ = split_micro_batches({"tokens": tokens, "attention_mask": attn, "mask": mask},
                                         c.cfg.algorithm.micro_batch_size,
                                         {"tokens": c.tokenizer.pad_id, "attention_mask": True,
                                          "mask": False})

            def loss_fn(mb, logits):
                lp, _ = token_logprobs(logits, mb["tokens"], vocab, 1.0)
                loss = -(lp * mb["mask"]).sum() / total
                return loss, {"loss": loss.detach()}

            c.ddp.zero_grad_buffer()
            c.optimizer.zero_grad()
            with c.trainer_precision():
                outs = run_schedule(c.ddp, mbs, loss_fn, forward_only=False,
                                    seq_length=tokens.shape[1])
            c.optimizer.step()
            invalidate_weight_caches(c.policy)  # the distributed optimizer writes via .data
            local = torch.tensor([float(sum(o["loss"] for o in outs)) if outs else 0.0],
                                 device=collective_device(c.dp_group))
            dist.all_reduce(local, group=c.dp_group)
            losses.append(float(local))
            if log is not None:
                log(step, float(local))
    finally:
        for g, lr in zip(c.optimizer.param_groups, base_lrs):
            g["lr"] = lr
    return losses
