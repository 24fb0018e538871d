"""`make demo`: the tiny policy at TP=2 on 2 CPU ranks, a forward pass over a few prompts,
log-prob and entropy statistics: the smallest multi-process example (README, "Running on more
than one process yourself"). `make demo` is the RL demo (`calibclip train --config tiny-cpu`).

Run with torchrun:
    torchrun --standalone --nproc-per-node=2 -m megatron_calibclip.demo --tp 2
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist

PROMPTS = [
    "What is 17 + 25? Answer: 42",
    "The capital of France is Paris.",
    "def add(a, b): return a + b",
    "FP8 noise pushes negative-advantage tokens below the clip bound.",
]


def encode(text: str) -> list[int]:
    """UTF-8 bytes as token ids (the tiny model's vocabulary covers 0..999)."""
    return list(text.encode("utf-8"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (1 here)")
    parser.add_argument("--preset", default="tiny", help="model preset")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args(argv)

    from megatron.core import parallel_state as ps

    from megatron_calibclip.models import (
        build_policy_model,
        build_reference_model,
        copy_weights,
        forward_logits,
        get_preset,
        shifted_logprobs_entropy,
    )
    from megatron_calibclip.parallel import ParallelLayout, initialize_distributed, teardown
    from megatron_calibclip.parallel.devices import collective_device, model_device

    torch.set_num_threads(1)
    start = time.perf_counter()
    env = initialize_distributed(ParallelLayout(tp=args.tp, pp=args.pp))
    if args.pp != 1:
        raise SystemExit("the forward demo runs one pipeline stage; use --pp 1")
    cfg = get_preset(args.preset)
    policy = build_policy_model(cfg, seed=args.seed)
    reference = build_reference_model(cfg)
    copy_weights(policy, reference)

    ids = [encode(p) for p in PROMPTS]
    width = max(len(x) for x in ids)
    dev = model_device(policy)
    tokens = torch.zeros(len(ids), width, dtype=torch.long, device=dev)
    valid = torch.zeros(len(ids), width - 1, dtype=torch.bool, device=dev)
    for i, x in enumerate(ids):  # right padding; padded targets are masked out
        tokens[i, : len(x)] = torch.tensor(x, device=dev)
        valid[i, : len(x) - 1] = True
    with torch.no_grad():
        logp, ent = shifted_logprobs_entropy(forward_logits(policy, tokens), tokens,
                                             cfg.vocab_size)
        ref_logp, _ = shifted_logprobs_entropy(forward_logits(reference, tokens), tokens,
                                               cfg.vocab_size)
    n_params = sum(p.numel() for p in policy.parameters())
    group = ps.get_tensor_model_parallel_group()
    total = torch.tensor([float(n_params)], device=collective_device(group))
    dist.all_reduce(total, group=group)
    if env.rank == 0:
        print(f"megatron-calibclip demo: preset={args.preset} TP={args.tp} ranks={env.world_size} "
              f"backend={dist.get_backend()} params={int(total.item()):,} "
              f"vocab={cfg.vocab_size} (padded {cfg.padded_vocab_size(args.tp)})")
        print(f"{'prompt':<44} {'tokens':>6} {'mean logp':>10} {'min logp':>9} "
              f"{'entropy':>8} {'|logp-ref|':>10}")
        for i, prompt in enumerate(PROMPTS):
            m = valid[i]
            lp, h = logp[i][m], ent[i][m]
            gap = (logp[i][m] - ref_logp[i][m]).abs().max()
            print(f"{prompt[:42]:<44} {int(m.sum()):>6} {lp.mean():>10.4f} {lp.min():>9.4f} "
                  f"{h.mean():>8.4f} {gap:>10.2e}")
        lp_all, h_all = logp[valid], ent[valid]
        print(f"all {int(valid.sum())} tokens: mean logp {lp_all.mean():.4f} "
              f"(uniform: {-math.log(cfg.vocab_size):.4f}), mean entropy {h_all.mean():.4f} "
              f"(max: {math.log(cfg.vocab_size):.4f}), policy vs BF16 reference max "
              f"|dlogp| {(logp - ref_logp)[valid].abs().max():.2e}")
        print(f"done in {time.perf_counter() - start:.1f}s")
    teardown()


if __name__ == "__main__":
    main()
