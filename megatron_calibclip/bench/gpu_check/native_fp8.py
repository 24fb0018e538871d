"""(b) Emulated vs native FP8 (`torch` backend: `torch._scaled_mm`) on a small GPT with the
same weights and tokens: forward log-probs, and backward in the hybrid format (E5M2 output
gradients): the gradient of the layers' input (the embedding output) and the weight
gradients of every FP8 linear.

Why: the emulation is the CPU reference every test trusts; on a GPU the `torch` backend runs
the same codes and scales through real FP8 GEMMs, forward, dgrad and wgrad. The two may
differ only by accumulation order, which must be small against the FP8 effect itself (FP8
vs the BF16 pass on the same weights), for log-probs and gradients alike. The model is our
emulated-linear spec explicitly (the comparison is between our two backends), built and
placed as the trainer does (bf16 parameters on CUDA, fp32 on the CPU); precision switched
in place.

Two levels of backward, because E5M2 has 2 mantissa bits: an ulp-level difference in one
GEMM's output flips E5M2 codes of the gradients downstream, so a model's gradients are
chaotic at the scale of the FP8 effect itself. Measured on the CPU (smoke model): the
emulation against itself on another GEMM path (fp8/gemm.py "fp32" vs "exact") moves the
input gradient by 0.09 (tensorwise) to 0.3 (rowwise) of the FP8 effect, "native" vs
"exact" by 0.9. Hence:
- `linear`: one FP8 linear of the model on fixed inputs and output gradients: forward,
  dgrad and wgrad of the two backends on the same operands, within 0.1 of that linear's
  FP8 effect (the GEMMs themselves; the tight check);
- `backward`: the whole model's input and weight gradients, recorded, and bounded by the
  FP8 effect (ratio <= 1: catches a wrong scale, format or layout, which land at >> 1).
"""
from __future__ import annotations

import torch

from megatron_calibclip.bench.gpu_check.common import (
    abs_diff,
    all_finite,
    build_gpt,
    case_error,
    cases_passed,
    random_tokens,
    rel_fro,
    token_logprobs,
)
from megatron_calibclip.bench.gpu_check.options import CheckOptions
from megatron_calibclip.parallel.devices import HOST

GRANULARITIES = ("tensorwise", "rowwise", "delayed")
THRESHOLDS = {
    # mean |logp(native) - logp(emulated)| <= this x mean |logp(emulated FP8) - logp(BF16)|
    "native_vs_emulated_over_fp8_effect_max": 0.1,
    # whole model: ||grad(native) - grad(emulated)||_F <= this x ||grad(emulated FP8) -
    # grad(BF16)||_F, input gradient and all FP8 linears' weight gradients (module doc)
    "model_grad_native_vs_emulated_over_fp8_effect_max": 1.0,
    # one linear on fixed operands: output, dgrad, wgrad, rel. Frobenius, same scale
    "linear_native_vs_emulated_over_fp8_effect_max": 0.1,
    "fp8_effect_min": 1e-6,  # FP8 really changed the log-probs (the switch took effect)
}
REFERENCE = ("the emulated backend (fp8/quantize.py codes, fp32 GEMMs) on the same weights "
             "and tokens; scale: the FP8 effect (emulated FP8 vs BF16)")


def _forward_backward(model, cfg, tokens, weights) -> dict[str, torch.Tensor]:
    """Log-probs, the gradient of the embedding output (the layers' input) and of every FP8
    linear's weight, for the loss -mean(weights * logp) (weights: a fixed +-1 per token,
    as advantages are)."""
    captured = {}

    def keep(module, inputs, output):
        output.retain_grad()
        captured["input"] = output

    handle = model.embedding.register_forward_hook(keep)
    try:
        model.zero_grad(set_to_none=True)
        lp = token_logprobs(model, cfg, tokens)
        (-(lp * weights).mean()).backward()
    finally:
        handle.remove()
    out = {"logp": lp.detach().float(), "dgrad": captured["input"].grad.detach().float()}
    out["wgrad"] = {name: p.grad.detach().float().clone() for name, p in model.named_parameters()
                    if ".linear_" in name and p.grad is not None}
    return out


def _fp8_pass(model, cfg, tokens, weights, granularity: str, backend: str) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe, reset_fp8_state, set_precision

    recipe = FP8Recipe(format="hybrid", granularity=granularity, backend=backend,
                       amax_history_len=4)
    set_precision(model, "fp8", recipe)
    reset_fp8_state(model)  # both backends start the delayed history from the same point
    if granularity == "delayed":
        _forward_backward(model, cfg, tokens, weights)  # scales from this batch's amaxes
    return _forward_backward(model, cfg, tokens, weights)


def _wgrad_rel(got: dict, want: dict) -> float:
    """Relative Frobenius distance over all FP8 linears' weight gradients at once."""
    if set(got) != set(want) or not got:
        raise ValueError(f"weight gradients differ in names: {sorted(set(got) ^ set(want))[:4]}")
    num = sum((got[n].double() - want[n].double()).square().sum() for n in want)
    den = sum(want[n].double().square().sum() for n in want)
    return (num / den.clamp(min=1e-300)).sqrt().item()


def _linear_pass(linear, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, dgrad and wgrad of one linear of the model on fixed operands."""
    xg = x.clone().requires_grad_(True)
    linear.weight.grad = None
    out, _ = linear(xg)
    out.backward(dy)
    return {"output": out.detach().float(), "dgrad": xg.grad.detach().float(),
            "wgrad": linear.weight.grad.detach().float().clone()}


def check_linear(model, linear, x, dy, granularity: str) -> dict:
    """Native vs emulated on one linear: the GEMMs alone, forward and backward."""
    from megatron_calibclip.fp8 import FP8Recipe, reset_fp8_state, set_precision

    set_precision(model, "bf16")
    bf16 = _linear_pass(linear, x, dy)
    fp8 = {}
    for backend in ("emulated", "torch"):
        set_precision(model, "fp8", FP8Recipe(format="hybrid", granularity=granularity,
                                              backend=backend, amax_history_len=4))
        reset_fp8_state(model)
        for _ in range(3 if granularity == "delayed" else 1):  # the same amax history
            fp8[backend] = _linear_pass(linear, x, dy)
    out: dict = {"ran": True}
    for name in ("output", "dgrad", "wgrad"):
        diff = rel_fro(fp8["torch"][name], fp8["emulated"][name])
        effect = rel_fro(fp8["emulated"][name], bf16[name])
        out[name] = {"native_vs_emulated_rel_fro": diff, "fp8_effect_rel_fro": effect,
                     "ratio": diff / max(effect, 1e-30)}
    limit = THRESHOLDS["linear_native_vs_emulated_over_fp8_effect_max"]
    out["passed"] = all_finite(out) and all(
        out[n]["ratio"] <= limit and out[n]["fp8_effect_rel_fro"] >= THRESHOLDS["fp8_effect_min"]
        for n in ("output", "dgrad", "wgrad"))
    return out


def check_granularity(model, cfg, tokens, weights, bf16: dict, granularity: str) -> dict:
    from megatron_calibclip.fp8.gemm import using_gemm_path

    with using_gemm_path("exact"):  # the emulation in the GPU's order (fp8/gemm.py)
        emulated = _fp8_pass(model, cfg, tokens, weights, granularity, "emulated")
        native = _fp8_pass(model, cfg, tokens, weights, granularity, "torch")
    out = {"ran": True, "native_vs_emulated": abs_diff(native["logp"], emulated["logp"]),
           "fp8_effect": abs_diff(emulated["logp"], bf16["logp"])}
    effect = out["fp8_effect"]["mean"]
    out["ratio"] = out["native_vs_emulated"]["mean"] / max(effect, 1e-30)
    grads = {}
    for name, distance in (("dgrad", rel_fro), ("wgrad", _wgrad_rel)):
        diff = distance(native[name], emulated[name])
        grad_effect = distance(emulated[name], bf16[name])
        grads[name] = {"native_vs_emulated_rel_fro": diff, "fp8_effect_rel_fro": grad_effect,
                       "ratio": diff / max(grad_effect, 1e-30)}
    out["backward"] = grads
    limit = THRESHOLDS["model_grad_native_vs_emulated_over_fp8_effect_max"]
    grads_ok = all(g["fp8_effect_rel_fro"] >= THRESHOLDS["fp8_effect_min"] and g["ratio"] <= limit
                   for g in grads.values())
    out["passed"] = (all_finite(out) and effect >= THRESHOLDS["fp8_effect_min"] and grads_ok
                     and out["ratio"] <= THRESHOLDS["native_vs_emulated_over_fp8_effect_max"])
    return out


def _linear_operands(linear, tokens: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, 1, in] with outlier channels and dY [tokens, 1, out], in the parameters'
    dtype (the same on any device: drawn on the host)."""
    gen = torch.Generator(device=HOST).manual_seed(4)
    out_features, in_features = linear.weight.shape
    x = torch.randn(tokens, 1, in_features, generator=gen, device=HOST)
    x[..., :: max(in_features // 7, 1)] *= 20
    dy = torch.randn(tokens, 1, out_features, generator=gen, device=HOST) * 1e-3
    dtype = linear.weight.dtype
    return x.to(device=device, dtype=dtype), dy.to(device=device, dtype=dtype)


def run(opts: CheckOptions) -> dict:
    from megatron_calibclip.fp8 import set_precision
    from megatron_calibclip.fp8.gemm import using_gemm_path

    model, cfg = build_gpt(opts.small_model, opts.device, "emulated")
    model.eval()  # no dropout anyway; gradients still flow
    tokens = random_tokens(opts.logprob_batch, opts.logprob_seq, cfg.vocab_size, opts.device)
    gen = torch.Generator(device=HOST).manual_seed(3)
    weights = (torch.randint(0, 2, (tokens.shape[0], tokens.shape[1] - 1), generator=gen,
                             device=HOST).float() * 2 - 1).to(opts.device)
    set_precision(model, "bf16")
    bf16 = _forward_backward(model, cfg, tokens, weights)
    linear = model.decoder.layers[0].mlp.linear_fc1
    x, dy = _linear_operands(linear, tokens.numel(), opts.device)
    cases = {}
    for granularity in GRANULARITIES:
        try:
            case = check_granularity(model, cfg, tokens, weights, bf16, granularity)
            with using_gemm_path("exact"):
                case["linear"] = check_linear(model, linear, x, dy, granularity)
            case["passed"] = case["passed"] and case["linear"]["passed"]
            cases[granularity] = case
        except Exception as err:  # noqa: BLE001 - one recipe's failure is its own record
            cases[granularity] = case_error(err)
    return {"ran": True, "reference": REFERENCE, "thresholds": THRESHOLDS,
            "model": vars(opts.small_model), "params_dtype": str(next(model.parameters()).dtype),
            "format": "hybrid (E4M3 forward, E5M2 output gradients)",
            "tokens": list(tokens.shape), "linear": "decoder.layers.0.mlp.linear_fc1, "
            f"{list(x.shape)} -> {list(dy.shape)}", "cases": cases, "passed": cases_passed(cases)}
