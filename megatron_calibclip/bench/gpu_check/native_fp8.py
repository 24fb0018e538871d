"""(b) Emulated vs native FP8 log-probs of a small GPT, on the same weights.

Why: the emulation is the CPU reference every test trusts; on a GPU the `torch` backend runs
the same codes and scales through real FP8 GEMMs (`torch._scaled_mm`). Their log-probs may
differ only by accumulation order, which must be small against the FP8 effect itself (FP8
vs the BF16 pass on the same weights). One model, precision switched in place.
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

GRANULARITIES = ("tensorwise", "rowwise", "delayed")
THRESHOLDS = {
    # mean |logp(native) - logp(emulated)| <= this x mean |logp(emulated FP8) - logp(BF16)|
    "native_vs_emulated_over_fp8_effect_max": 0.1,
    "fp8_effect_min": 1e-6,  # FP8 really changed the log-probs (the switch took effect)
}


def _fp8_logprobs(model, cfg, tokens, granularity: str, backend: str) -> torch.Tensor:
    from megatron_calibclip.fp8 import FP8Recipe, reset_fp8_state, set_precision

    recipe = FP8Recipe(format="hybrid", granularity=granularity, backend=backend,
                       amax_history_len=4)
    set_precision(model, "fp8", recipe)
    reset_fp8_state(model)  # both backends start the delayed history from the same point
    if granularity == "delayed":
        token_logprobs(model, cfg, tokens)  # scales from this batch's amaxes
    return token_logprobs(model, cfg, tokens)


def check_granularity(model, cfg, tokens, lp_bf16, granularity: str) -> dict:
    from megatron_calibclip.fp8.gemm import using_gemm_path

    with using_gemm_path("exact"):  # the emulation in the GPU's order (fp8/gemm.py)
        emulated = _fp8_logprobs(model, cfg, tokens, granularity, "emulated")
        native = _fp8_logprobs(model, cfg, tokens, granularity, "torch")
    out = {"native_vs_emulated": abs_diff(native, emulated),
           "fp8_effect": abs_diff(emulated, lp_bf16)}
    effect = out["fp8_effect"]["mean"]
    out["ratio"] = out["native_vs_emulated"]["mean"] / max(effect, 1e-30)
    out["passed"] = (all_finite(out) and effect >= THRESHOLDS["fp8_effect_min"]
                     and out["ratio"] <= THRESHOLDS["native_vs_emulated_over_fp8_effect_max"])
    return out


@torch.no_grad()
def run(opts: CheckOptions) -> dict:
    from megatron_calibclip.fp8 import set_precision

    model, cfg = build_emulated_gpt(opts.small_model, opts.device)
    model.eval()
    tokens = random_tokens(opts.logprob_batch, opts.logprob_seq, cfg.vocab_size, opts.device)
    set_precision(model, "bf16")
    lp_bf16 = token_logprobs(model, cfg, tokens)
    cases = {}
    for granularity in GRANULARITIES:
        try:
            cases[granularity] = check_granularity(model, cfg, tokens, lp_bf16, granularity)
        except Exception as err:  # noqa: BLE001 - one recipe's failure is its own record
            cases[granularity] = {"error": error_record(err), "passed": False}
    return {"thresholds": THRESHOLDS, "model": vars(opts.small_model),
            "tokens": list(tokens.shape), "cases": cases,
            "passed": all(c["passed"] for c in cases.values())}
