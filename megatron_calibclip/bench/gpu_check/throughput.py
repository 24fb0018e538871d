"""(e) Training-step throughput, FP8 over BF16, of a 1-3B-parameter shape, in one run.

Why side by side: a ratio of two numbers measured in the same process on the same weights,
interleaved step by step, survives clock and thermal drift that separate runs would not.
A step is an update of the trainer's policy architecture (local spec with the emulated
linears, fp32 parameters: the trainer's CPU flow; on a GPU the trainer holds bf16 parameters
with megatron's fp32 main parameters, which this bench does not build): forward, -mean
log-prob, backward, AdamW. "bf16" is that model's BF16 mode (fp32 GEMMs on bf16-rounded
operands: the emulation, not tensor-core BF16), "fp8" its FP8 mode with the `torch` backend
(real FP8 GEMMs, forward and backward). So the ratio describes this package, not the
hardware's FP8 speed-up (which needs TE's spec in the trainer): it is recorded against a
target, and only correctness (finite losses, positive throughput) gates the check.
"""
from __future__ import annotations

import statistics

import torch

from megatron_calibclip.bench.gpu_check.common import (
    all_finite,
    build_emulated_gpt,
    now,
    random_tokens,
    token_logprobs,
)
from megatron_calibclip.bench.gpu_check.options import CheckOptions

MODES = ("bf16", "fp8")
THRESHOLDS = {"losses_finite": True, "tokens_per_s_min": 0.0}
TARGETS = {"fp8_over_bf16_tokens_per_s_min": 1.0}  # recorded, not gating (see module doc)


def _train_step(model, cfg, tokens: torch.Tensor, optimizer) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = -token_logprobs(model, cfg, tokens).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def run(opts: CheckOptions) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe, set_precision

    model, cfg = build_emulated_gpt(opts.big_model, opts.device, seed=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    tokens = random_tokens(opts.throughput_batch, opts.throughput_seq, cfg.vocab_size,
                           opts.device, seed=2)
    recipe = FP8Recipe(format="hybrid", granularity="tensorwise", backend="torch")
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    losses: dict[str, list[float]] = {m: [] for m in MODES}
    peak_gib: dict[str, float] = {}
    for i in range(opts.throughput_warmup_steps + opts.throughput_steps):
        for mode in MODES:  # interleaved: both modes see the same drift
            set_precision(model, mode, recipe)
            if opts.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t = now(opts.device)
            losses[mode].append(_train_step(model, cfg, tokens, optimizer))
            dt = now(opts.device) - t
            if i >= opts.throughput_warmup_steps:
                seconds[mode].append(dt)
            if opts.device == "cuda":
                peak_gib[mode] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    tokens_per_step = tokens.numel()
    rate = {m: tokens_per_step / statistics.median(seconds[m]) for m in MODES}
    ratio = rate["fp8"] / rate["bf16"]
    out = {
        "what": "fwd + bwd + AdamW of the trainer's policy model (emulated-linear spec, fp32 "
                "parameters); bf16 = its BF16 mode (emulated: fp32 GEMMs on bf16 values), "
                "fp8 = FP8 tensorwise via torch._scaled_mm, forward and backward",
        "model": vars(opts.big_model), "parameters": cfg.num_parameters(),
        "tokens_per_step": tokens_per_step, "measured_steps": opts.throughput_steps,
        "step_seconds": {m: [round(s, 4) for s in seconds[m]] for m in MODES},
        "tokens_per_s": {m: round(v, 1) for m, v in rate.items()},
        "fp8_over_bf16_tokens_per_s": round(ratio, 4),
        "losses": losses, "peak_memory_gib": peak_gib,
        "thresholds": THRESHOLDS, "targets": TARGETS,
        "target_met": ratio >= TARGETS["fp8_over_bf16_tokens_per_s_min"],
    }
    out["passed"] = all_finite(losses) and min(rate.values()) > THRESHOLDS["tokens_per_s_min"]
    return out
