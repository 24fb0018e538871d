"""(e) Training-step throughput, FP8 over BF16, of a 1-3B-parameter shape, in one run.

Why side by side: a ratio of two numbers measured in the same process on the same weights,
interleaved step by step, survives clock and thermal drift that separate runs would not.
The model is the trainer's policy as the trainer builds it here (te_run.trainer_backend's
choice for the FP8 recipe below: megatron's TE spec with CUDA and transformer-engine, else
our emulated-linear spec; bf16 parameters on CUDA, fp32 on the CPU; placed with
place_on_device). A step is forward, -mean log-prob, backward, AdamW on the parameters
(the trainer's megatron optimizer keeps fp32 main parameters beside bf16 ones: not built
here; the step's GEMMs are the same). "bf16" is the model's BF16 mode (TE: FP8 off, BF16
tensor-core GEMMs; ours: the emulation's BF16 GEMMs), "fp8" its FP8 mode with the trainer's
backend (TE's FP8 GEMMs; ours: torch._scaled_mm on a GPU, the emulation on the CPU). The
ratio is recorded against a target; only correctness (finite losses, positive throughput)
gates the check.
"""
from __future__ import annotations

import statistics

import torch

from megatron_calibclip.bench.gpu_check.common import (
    all_finite,
    build_gpt,
    now,
    random_tokens,
    token_logprobs,
    trainer_backend_for,
)
from megatron_calibclip.bench.gpu_check.options import CheckOptions

MODES = ("bf16", "fp8")
THRESHOLDS = {"losses_finite": True, "tokens_per_s_min": 0.0}
TARGETS = {"fp8_over_bf16_tokens_per_s_min": 1.0}  # recorded, not gating (see module doc)
REFERENCE = "the same model's BF16 mode, interleaved step by step (a ratio, not a reference)"


def _train_step(model, cfg, tokens: torch.Tensor, optimizer) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = -token_logprobs(model, cfg, tokens).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def run(opts: CheckOptions) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe, set_precision
    from megatron_calibclip.fp8.backend import linear_backend

    recipe = FP8Recipe(format="hybrid", granularity="tensorwise", backend="auto")
    spec = "te" if trainer_backend_for(opts.device, recipe) == "te" else "emulated"
    model, cfg = build_gpt(opts.big_model, opts.device, spec, seed=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    tokens = random_tokens(opts.throughput_batch, opts.throughput_seq, cfg.vocab_size,
                           opts.device, seed=2)
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
        "ran": True, "reference": REFERENCE,
        "what": "fwd + bwd + AdamW of the trainer's policy model as built here; bf16 = its "
                "BF16 mode, fp8 = FP8 hybrid tensorwise on the trainer's backend",
        "layer_spec": model.calibclip_backend,
        "fp8_backend": "te" if spec == "te" else linear_backend(recipe.backend),
        "params_dtype": str(next(model.parameters()).dtype),
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
