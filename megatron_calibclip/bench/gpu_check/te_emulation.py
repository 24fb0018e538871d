"""(f) Transformer Engine against our emulation, on the same weights: does the CPU emulation
compute what the trainer's TE path computes?

Per FP8 recipe TE runs here (tensorwise, delayed, blockwise on Hopper, mxfp8 from compute
capability 10.0; hybrid format), two comparisons:
- `model`: a small GPT built twice as the trainer builds it (build_policy_model, BF16
  parameters, place_on_device): megatron's TE spec (models.te_layer_spec) and our emulated
  spec, the emulated weights copied into the TE model by checkpoint name (checkpoint/
  mapping.py local_to_checkpoint_name: the local spec's norms become TE's fused
  `layer_norm_weight`; every other name is the same). Log-probs of the same tokens through
  the trainer's path (trainer/forward.py compute_logprobs), the TE model in FP8 through
  megatron's own FP8 context (fp8.set_precision sets config.fp8 on a model whose
  calibclip_backend is "te"; TransformerBlock enters fp8_autocast from it), the emulated one
  in the same recipe. Passes if mean |emulated - TE| <= 0.25 x the FP8 effect (TE FP8 vs
  TE with FP8 off) + 2 x the gap of the two high-precision paths, and that gap is below
  half the FP8 effect (else the comparison cannot resolve FP8 at all). The sequence length
  divides by 32, so TE's FP8 GEMMs see token counts they take without padding.
- `linear`: one te.pytorch.Linear under TE's autocast vs our emulated column-parallel
  linear, same BF16 weight, input and output gradient: output, dgrad, wgrad, each within
  the same bound relative to TE's FP8 effect on it.
And one case of its own, `padding` (gpu_check/padding.py): left-padded rows through the
trainer's path on the TE spec in BF16 against each row alone (cuDNN reads a padding mask as
lengths).
A recipe this GPU's compute capability lacks is recorded as not supported by this GPU;
anything else TE refuses is a failure. On the CPU the whole section is not run.
"""
from __future__ import annotations

import torch

from megatron_calibclip.bench.gpu_check.common import (
    NO_CUDA,
    NO_TE,
    all_finite,
    build_gpt,
    case_error,
    cases_passed,
    not_run,
    random_tokens,
    rel_fro,
    te_installed,
    te_recipe_problem,
    trainer_logprobs,
)
from megatron_calibclip.bench.gpu_check.options import CheckOptions
from megatron_calibclip.bench.gpu_check.padding import check_padding
from megatron_calibclip.parallel.devices import HOST

GRANULARITIES = ("tensorwise", "delayed", "blockwise", "mxfp8")
THRESHOLDS = {
    # |emulated FP8 - TE FP8| <= this x |TE FP8 - TE FP8 off| + 2 x |emulated HP - TE HP|
    # (log-probs: means over tokens; the linear: relative Frobenius per output/dgrad/wgrad)
    "emulated_vs_te_over_fp8_effect_max": 0.25,
    "hp_gap_allowance_factor": 2.0,
    # the two high-precision paths must agree well inside the FP8 effect (resolving power)
    "hp_gap_over_fp8_effect_max": 0.5,
    "fp8_effect_min": 1e-6,
}
REFERENCE = ("Transformer Engine: megatron's TE layer spec in FP8 through megatron's FP8 "
             "context (log-probs), te.pytorch.Linear under TE's autocast (one GEMM, forward "
             "and backward); same BF16 weights, tokens and gradients")


def copy_by_checkpoint_names(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """Copy every parameter of our (local/emulated spec) model into a TE-spec model by
    checkpoint name; both sides must be covered exactly. Returns the count."""
    from megatron_calibclip.checkpoint.mapping import local_to_checkpoint_name

    dst_params = dict(dst.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, p in src.named_parameters():
            target = local_to_checkpoint_name(name)
            if target not in dst_params:
                raise KeyError(f"the TE model has no parameter {target!r} (from {name!r})")
            if dst_params[target].shape != p.shape:
                raise ValueError(f"{target}: TE shape {tuple(dst_params[target].shape)} vs "
                                 f"ours {tuple(p.shape)}")
            dst_params[target].copy_(p)
            seen.add(target)
    missing = sorted(set(dst_params) - seen)
    if missing:
        raise KeyError(f"TE parameters our model does not have: {missing[:6]}")
    return len(seen)


def _judge(fp8_diff: float, effect: float, hp_gap: float) -> dict:
    allowed = (THRESHOLDS["emulated_vs_te_over_fp8_effect_max"] * effect
               + THRESHOLDS["hp_gap_allowance_factor"] * hp_gap)
    out = {"emulated_vs_te_fp8": fp8_diff, "te_fp8_effect": effect, "hp_gap": hp_gap,
           "allowed": allowed, "ratio": fp8_diff / max(effect, 1e-30)}
    out["passed"] = (all_finite(out) and effect >= THRESHOLDS["fp8_effect_min"]
                     and fp8_diff <= allowed
                     and hp_gap <= THRESHOLDS["hp_gap_over_fp8_effect_max"] * effect)
    return out


def check_model(opts: CheckOptions, emu_model, cfg, tokens, recipe) -> dict:
    """Log-probs: TE spec (FP8 on / off) vs the emulated spec, same weights and tokens."""
    from megatron_calibclip.fp8 import FP8Recipe, reset_fp8_state, set_precision
    from megatron_calibclip.fp8.gemm import using_gemm_path
    from megatron_calibclip.fp8.te import te_token_multiple

    te_model, _ = build_gpt(opts.small_model, opts.device, "te", params_dtype=torch.bfloat16)
    copied = copy_by_checkpoint_names(emu_model, te_model)
    te_model.eval()
    te_model.calibclip_token_multiple = te_token_multiple(recipe)  # te_run.prepare_te_model
    emu_recipe = FP8Recipe(format=recipe.format, granularity=recipe.granularity,
                           backend="emulated")
    batch = tokens.shape[0]

    def logp(model):
        return trainer_logprobs(model, cfg, tokens, batch)

    with torch.no_grad(), using_gemm_path("exact"):
        set_precision(te_model, "bf16")
        set_precision(emu_model, "bf16")
        te_hp, emu_hp = logp(te_model), logp(emu_model)
        set_precision(te_model, "fp8", recipe)
        set_precision(emu_model, "fp8", emu_recipe)
        reset_fp8_state(emu_model)
        for _ in range(2 if recipe.granularity == "delayed" else 0):  # the same amax history
            logp(te_model)
            logp(emu_model)
        te_fp8, emu_fp8 = logp(te_model), logp(emu_model)
    out = _judge((emu_fp8 - te_fp8).abs().mean().item(), (te_fp8 - te_hp).abs().mean().item(),
                 (emu_hp - te_hp).abs().mean().item())
    out.update(ran=True, parameters_copied=copied,
               emulated_vs_te_fp8_max=(emu_fp8 - te_fp8).abs().max().item(),
               emulated_fp8_effect=(emu_fp8 - emu_hp).abs().mean().item())
    return out


def _linear_operands(shape: tuple[int, int, int], device: str):
    tokens, hidden, out = shape
    gen = torch.Generator(device=HOST).manual_seed(5)  # the same operands on any device
    w = torch.randn(out, hidden, generator=gen, device=HOST) * 0.05
    x = torch.randn(tokens, 1, hidden, generator=gen, device=HOST)
    dy = torch.randn(tokens, 1, out, generator=gen, device=HOST) * 1e-3
    return [t.to(device=device, dtype=torch.bfloat16) for t in (w, x, dy)]


def _pass(module, x, dy, te_recipe=None) -> dict:
    """Output, dgrad, wgrad of one linear (TE's under autocast when te_recipe is given)."""
    from megatron_calibclip.fp8 import te_fp8_autocast

    xg = x.clone().requires_grad_(True)
    module.weight.grad = None
    if te_recipe is not None:
        with te_fp8_autocast(te_recipe):
            y = module(xg)
    else:
        y = module(xg)
    y = y[0] if isinstance(y, tuple) else y  # megatron's linears return (output, bias)
    y.backward(dy)
    return {"output": y.detach().float(), "dgrad": xg.grad.detach().float(),
            "wgrad": module.weight.grad.detach().float().clone()}


def check_linear(opts: CheckOptions, recipe) -> dict:
    """te.pytorch.Linear (TE's API: Linear(in, out, bias=..., params_dtype=..., device=...),
    transformer_engine/pytorch/module/linear.py) vs EmulatedColumnParallelLinear."""
    import transformer_engine.pytorch as te
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_calibclip.fp8 import (
        EmulatedColumnParallelLinear,
        FP8Recipe,
        reset_fp8_state,
        set_precision,
    )
    from megatron_calibclip.models import place_on_device

    w, x, dy = _linear_operands(opts.linear_shape, opts.device)
    hidden, out_features = w.shape[1], w.shape[0]
    te_lin = te.Linear(hidden, out_features, bias=False, params_dtype=torch.bfloat16,
                       device=opts.device)
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                               use_cpu_initialization=True, gradient_accumulation_fusion=False,
                               params_dtype=torch.bfloat16, bf16=True)
    emu = EmulatedColumnParallelLinear(hidden, out_features, config=config,
                                       init_method=torch.nn.init.zeros_, bias=False,
                                       gather_output=False, tp_comm_buffer_name="fc1")
    place_on_device(emu, torch.device(opts.device))
    with torch.no_grad():
        te_lin.weight.copy_(w)
        emu.weight.copy_(w)
    te_hp = _pass(te_lin, x, dy)
    set_precision(emu, "bf16")
    emu_hp = _pass(emu, x, dy)
    set_precision(emu, "fp8", FP8Recipe(format=recipe.format, granularity=recipe.granularity,
                                        backend="emulated"))
    reset_fp8_state(emu)
    for _ in range(3 if recipe.granularity == "delayed" else 1):  # exercise the amax history
        te_fp8, emu_fp8 = _pass(te_lin, x, dy, recipe), _pass(emu, x, dy)
    out: dict = {"ran": True, "shape": list(opts.linear_shape)}
    for name in ("output", "dgrad", "wgrad"):
        out[name] = _judge(rel_fro(emu_fp8[name], te_fp8[name]),
                           rel_fro(te_fp8[name], te_hp[name]), rel_fro(emu_hp[name], te_hp[name]))
    out["passed"] = all(out[n]["passed"] for n in ("output", "dgrad", "wgrad"))
    return out


def check_recipe(opts: CheckOptions, emu_model, cfg, tokens, granularity: str) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe

    recipe = FP8Recipe(format="hybrid", granularity=granularity)
    out: dict = {"ran": True}
    for name, check in (("model", lambda: check_model(opts, emu_model, cfg, tokens, recipe)),
                        ("linear", lambda: check_linear(opts, recipe))):
        try:
            out[name] = check()
        except Exception as err:  # noqa: BLE001 - the other comparison still runs
            out[name] = case_error(err)
    out["passed"] = cases_passed({"model": out["model"], "linear": out["linear"]})
    return out


def check_te_padding(opts: CheckOptions, emu_model, cfg) -> dict:
    """The `padding` case (gpu_check/padding.py) on megatron's TE spec in BF16, the same
    weights as the other cases: the attention cuDNN runs on this GPU."""
    from megatron_calibclip.fp8 import set_precision

    te_model, _ = build_gpt(opts.small_model, opts.device, "te", params_dtype=torch.bfloat16)
    copy_by_checkpoint_names(emu_model, te_model)
    te_model.eval()
    set_precision(te_model, "bf16")
    return check_padding(te_model, cfg, opts.logprob_seq, opts.device)


def run(opts: CheckOptions) -> dict:
    head = {"reference": REFERENCE, "thresholds": THRESHOLDS}
    if opts.device != "cuda" or not te_installed():
        return {**head, **not_run("needs CUDA and transformer-engine",
                                  NO_CUDA if opts.device != "cuda" else NO_TE)}
    emu_model, cfg = build_gpt(opts.small_model, opts.device, "emulated",
                               params_dtype=torch.bfloat16)
    emu_model.eval()
    tokens = random_tokens(opts.logprob_batch, opts.logprob_seq, cfg.vocab_size, opts.device,
                           seed=6)
    cases = {}
    for granularity in GRANULARITIES:
        problem = te_recipe_problem(granularity, opts.device)
        if problem is not None:
            cases[granularity] = problem
            continue
        try:
            cases[granularity] = check_recipe(opts, emu_model, cfg, tokens, granularity)
        except Exception as err:  # noqa: BLE001 - one recipe's failure is its own record
            cases[granularity] = case_error(err)
    try:
        cases["padding"] = check_te_padding(opts, emu_model, cfg)
    except Exception as err:  # noqa: BLE001 - its own record
        cases["padding"] = case_error(err)
    return {**head, "ran": True, "model": vars(opts.small_model), "params_dtype": "bf16",
            "tokens": list(tokens.shape), "format": "hybrid", "cases": cases,
            "passed": cases_passed(cases)}
