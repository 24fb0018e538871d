"""Benchmark: the per-token log-prob + entropy kernel before and after removing its mask passes.

The kernel (parallel/vocab_parallel.py) runs over [tokens, vocabulary] logits six times per
RL step (old, reference, two shadow and two update forwards) and twice backward. Until the
speed pass of issue 15 it masked TP-padding columns with masked_fill / where against full
zero tensors even when there were none; now the masks run only when padding exists, and the
backward builds 0 - a - b without a zero tensor. Both are timed side by side here on the
same logits (SmolLM2's 49152 vocabulary, 752 tokens by default), and their outputs and
gradients compared bit for bit (signs of zero included).

Run:  .venv/bin/python benchmarks/speed/bench_logprob_kernel.py [--tokens 752] [--vocab 49152]
Prints one JSON document.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


class _Before(torch.autograd.Function):
    """The kernel as it was (single rank), kept here as the benchmark's reference."""

    @staticmethod
    def forward(ctx, logits, targets, true_vocab_size):
        x = logits.float()
        local_v = x.shape[-1]
        valid_col = torch.arange(local_v) < true_vocab_size
        x = x.masked_fill(~valid_col, float("-inf"))
        m = x.max(dim=-1).values
        shifted = torch.where(valid_col, x - m.unsqueeze(-1), torch.zeros_like(x))
        e = torch.where(valid_col, torch.exp(shifted), torch.zeros_like(x))
        idx = targets.clamp(0, local_v - 1)
        t_logit = torch.gather(shifted, -1, idx.unsqueeze(-1)).squeeze(-1)
        sum_e, sum_ex = e.sum(-1), (e * shifted).sum(-1)
        log_sum_e = torch.log(sum_e)
        mean_shifted = sum_ex / sum_e
        ctx.save_for_backward(x, m + log_sum_e, m + mean_shifted, idx, valid_col)
        return t_logit - log_sum_e, log_sum_e - mean_shifted

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        x, log_z, mean_x, idx, valid_col = ctx.saved_tensors
        p = torch.exp(x - log_z.unsqueeze(-1))
        grad = torch.zeros_like(x)
        centered = torch.where(valid_col, x - mean_x.unsqueeze(-1), torch.zeros_like(x))
        grad = grad - grad_entropy.unsqueeze(-1) * p * centered
        grad = grad - grad_logp.unsqueeze(-1) * p
        onehot = torch.zeros_like(x)
        onehot.scatter_(-1, idx.unsqueeze(-1), torch.ones_like(idx, dtype=x.dtype).unsqueeze(-1))
        return grad + grad_logp.unsqueeze(-1) * onehot, None, None


def _run(fn, logits, targets, grad_logp, grad_ent):
    x = logits.clone().requires_grad_(True)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(logits, targets)
    t1 = time.perf_counter()
    lp, ent = fn(x, targets)
    (lp * grad_logp + ent * grad_ent).sum().backward()
    t2 = time.perf_counter()
    return (t1 - t0, t2 - t1), (lp.detach(), ent.detach(), x.grad)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def main() -> None:
    from megatron_calibclip.parallel.vocab_parallel import vocab_parallel_logprobs_entropy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=752)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=g) * 3
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    grad_logp = torch.randn(args.tokens, generator=g)
    grad_ent = torch.randn(args.tokens, generator=g)
    arms = {"before": lambda x, t: _Before.apply(x, t, args.vocab),
            "after": lambda x, t: vocab_parallel_logprobs_entropy(x, t)}
    times: dict[str, list] = {k: [] for k in arms}
    outs = {}
    for _ in range(args.repeats):  # interleaved, best of `repeats`
        for name, fn in arms.items():
            t, outs[name] = _run(fn, logits, targets, grad_logp, grad_ent)
            times[name].append(t)
    best = {k: {"forward_s": round(min(t[0] for t in v), 4),
                "forward_backward_s": round(min(t[1] for t in v), 4)} for k, v in times.items()}
    print(json.dumps({
        "benchmark": "logprob_kernel", "tokens": args.tokens, "vocab": args.vocab,
        "threads": torch.get_num_threads(), **best,
        "speedup_forward": round(best["before"]["forward_s"] / best["after"]["forward_s"], 2),
        "speedup_forward_backward": round(best["before"]["forward_backward_s"]
                                          / best["after"]["forward_backward_s"], 2),
        "bit_identical": all(torch.equal(_bits(a), _bits(b))
                             for a, b in zip(outs["before"], outs["after"])),
    }, indent=2))


if __name__ == "__main__":
    main()
