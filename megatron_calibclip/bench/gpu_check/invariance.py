"""(c) Batch invariance on the device: log-probs with micro-batches of 2 vs 4 sequences.

Why: a sequence's log-probs should not depend on which other sequences share its forward,
or the ratio pi_theta / pi_old picks up noise from batching alone. BF16 and blockwise FP8
(1x128 tiles: each token scaled on its own) should be invariant up to GEMM order; tensorwise
FP8 is not by design (one activation scale per micro-batch), so its figures are recorded,
not bounded. Blockwise runs through the `torch` backend when it takes it; a refusal is
recorded as "unsupported" with the reason, and the emulated blockwise GEMM is measured too.
"""
from __future__ import annotations

import torch

from megatron_calibclip.bench.gpu_check.common import (
    abs_diff,
    all_finite,
    build_emulated_gpt,
    error_record,
    random_tokens,
    token_logprobs,
)
from megatron_calibclip.bench.gpu_check.options import CheckOptions

# (mode, granularity, backend, batch invariance expected)
CASES = (("bf16", None, None, True), ("fp8", "tensorwise", "torch", False),
         ("fp8", "blockwise", "torch", True), ("fp8", "blockwise", "emulated", True))
THRESHOLDS = {  # for the cases where invariance is expected
    "max_abs_logprob_diff": 1e-2,
    "mean_abs_logprob_diff": 1e-4,
}


def _micro_batched(model, cfg, tokens: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([token_logprobs(model, cfg, chunk) for chunk in tokens.split(size)])


def check_case(model, cfg, tokens, mode, granularity, backend, expected) -> dict:
    from megatron_calibclip.config import ConfigError
    from megatron_calibclip.fp8 import FP8Recipe, set_precision

    recipe = None if granularity is None else FP8Recipe(granularity=granularity, backend=backend)
    set_precision(model, mode, recipe)
    try:
        lp2 = _micro_batched(model, cfg, tokens, 2)
    except ConfigError as err:  # the backend refuses this recipe
        return {"unsupported": error_record(err), "passed": True}
    lp4 = _micro_batched(model, cfg, tokens, 4)
    out = {"invariance_expected": expected, "mb2_vs_mb4": abs_diff(lp2, lp4)}
    within = (out["mb2_vs_mb4"]["max"] <= THRESHOLDS["max_abs_logprob_diff"]
              and out["mb2_vs_mb4"]["mean"] <= THRESHOLDS["mean_abs_logprob_diff"])
    out["passed"] = all_finite(out) and (within or not expected)
    return out


@torch.no_grad()
def run(opts: CheckOptions) -> dict:
    model, cfg = build_emulated_gpt(opts.small_model, opts.device)
    model.eval()
    tokens = random_tokens(opts.logprob_batch, opts.logprob_seq, cfg.vocab_size, opts.device,
                           seed=1)
    cases = {}
    for mode, granularity, backend, expected in CASES:
        key = mode if granularity is None else f"{granularity}/{backend}"
        try:
            cases[key] = check_case(model, cfg, tokens, mode, granularity, backend, expected)
        except Exception as err:  # noqa: BLE001 - one case's failure is its own record
            cases[key] = {"error": error_record(err), "passed": False}
    return {"thresholds": THRESHOLDS, "model": vars(opts.small_model),
            "tokens": list(tokens.shape), "cases": cases,
            "passed": all(c["passed"] for c in cases.values())}
