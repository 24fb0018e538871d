"""(c) Batch invariance on the device: log-probs with micro-batches of 2 vs 4 sequences,
through the trainer's own log-prob path (trainer/forward.py compute_logprobs) on the model
the trainer builds here (te_run.trainer_backend's choice: megatron's TE spec with CUDA and
transformer-engine, else our emulated-linear spec; the trainer's params dtype).

Why: a sequence's log-probs should not depend on which other sequences share its forward,
or the ratio pi_theta / pi_old picks up noise from batching alone. BF16 and blockwise FP8
(1x128 tiles: each token scaled on its own) should be invariant up to GEMM order; tensorwise
FP8 is not by design (one activation scale per micro-batch), so its figures are recorded,
not bounded. Cases per spec:
- ours (the CPU, or CUDA without TE): bf16; tensorwise on the trainer's backend (`auto`:
  torch._scaled_mm with CUDA, the emulation on the CPU); blockwise on the emulation (the
  `torch` backend has no blockwise GEMM: the trainer refuses that recipe, so it is not a
  case here);
- te: bf16 (FP8 off), tensorwise and blockwise through TE (blockwise runs on Hopper only:
  elsewhere recorded as not supported by this GPU).
A refusal or an exception in any case is a failure.
"""
from __future__ import annotations

from megatron_calibclip.bench.gpu_check.common import (
    abs_diff,
    all_finite,
    build_gpt,
    case_error,
    cases_passed,
    random_tokens,
    te_recipe_problem,
    trainer_backend_for,
    trainer_logprobs,
)
from megatron_calibclip.bench.gpu_check.options import CheckOptions

# (key, mode, granularity, backend, batch invariance expected), per spec
CASES = {
    "ours": (("bf16", "bf16", None, None, True),
             ("tensorwise/auto", "fp8", "tensorwise", "auto", False),
             ("blockwise/emulated", "fp8", "blockwise", "emulated", True)),
    "te": (("bf16", "bf16", None, None, True),
           ("tensorwise/te", "fp8", "tensorwise", "auto", False),
           ("blockwise/te", "fp8", "blockwise", "auto", True)),
}
THRESHOLDS = {  # for the cases where invariance is expected
    "max_abs_logprob_diff": 1e-2,
    "mean_abs_logprob_diff": 1e-4,
}
REFERENCE = ("the same sequences' log-probs computed in micro-batches of 4 (vs 2), same "
             "model and weights, through trainer/forward.py compute_logprobs")


def check_case(model, cfg, tokens, spec: str, case: tuple, device: str) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe, set_precision
    from megatron_calibclip.fp8.te import te_token_multiple

    _, mode, granularity, backend, expected = case
    recipe = None if granularity is None else FP8Recipe(granularity=granularity, backend=backend)
    if spec == "te" and recipe is not None:
        problem = te_recipe_problem(granularity, device)
        if problem is not None:
            return problem
        # what te_run.prepare_te_model marks on the trainer's TE policy
        model.calibclip_token_multiple = te_token_multiple(recipe)
    set_precision(model, mode, recipe)
    lp2 = trainer_logprobs(model, cfg, tokens, 2)
    lp4 = trainer_logprobs(model, cfg, tokens, 4)
    out = {"ran": True, "invariance_expected": expected, "mb2_vs_mb4": abs_diff(lp2, lp4)}
    if recipe is not None and spec == "ours":
        from megatron_calibclip.fp8.backend import linear_backend

        out["backend"] = linear_backend(backend)
    within = (out["mb2_vs_mb4"]["max"] <= THRESHOLDS["max_abs_logprob_diff"]
              and out["mb2_vs_mb4"]["mean"] <= THRESHOLDS["mean_abs_logprob_diff"])
    out["passed"] = all_finite(out) and (within or not expected)
    return out


def run(opts: CheckOptions) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe

    spec = trainer_backend_for(opts.device, FP8Recipe(granularity="tensorwise"))
    model, cfg = build_gpt(opts.small_model, opts.device, "te" if spec == "te" else "emulated")
    model.eval()
    tokens = random_tokens(opts.logprob_batch, opts.logprob_seq, cfg.vocab_size, opts.device,
                           seed=1)
    cases = {}
    for case in CASES[spec]:
        key = case[0]
        try:
            cases[key] = check_case(model, cfg, tokens, spec, case, opts.device)
        except Exception as err:  # noqa: BLE001 - one case's failure is its own record
            cases[key] = case_error(err)
    return {"ran": True, "reference": REFERENCE, "thresholds": THRESHOLDS,
            "layer_spec": model.calibclip_backend, "model": vars(opts.small_model),
            "params_dtype": str(next(model.parameters()).dtype),
            "tokens": list(tokens.shape), "cases": cases, "passed": cases_passed(cases)}
