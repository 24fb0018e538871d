#!/usr/bin/env python
"""Device check: does the CPU emulation compute what Transformer Engine computes?

For each FP8 recipe TE can run on this GPU (tensorwise, delayed, blockwise, mxfp8; e4m3 and
hybrid), two comparisons on the same weights and inputs:
  1. one linear layer: te.pytorch.Linear under te_fp8_autocast vs the emulated
     Column-parallel linear (forward output, input grad, weight grad), relative max error;
  2. a small GPT (2 layers, hidden 256): the TE layer spec with megatron's FP8 config vs the
     local spec with emulated linears; log-probs of the same tokens. The emulation passes if
     its distance to TE's FP8 log-probs is well below the FP8 effect itself (TE FP8 vs TE
     with FP8 off), on top of the high-precision gap between the two specs.
Exit 0: all checks that ran passed; 1: a check failed; 2: cannot run (no CUDA / no TE).

    python tools/fp8_device_check.py [--granularities tensorwise delayed ...] [--json out.json]

Needs one NVIDIA GPU (FP8: Ada/Hopper or newer; mxfp8: Blackwell) and `pip install -e .[gpu]`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys


def _unavailable() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available (this check needs an NVIDIA GPU)"
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed (pip install -e '.[gpu]')"
    return None


def _support(granularity: str) -> tuple[bool, str]:
    """TE's own capability checks (names moved between TE releases: try both)."""
    names = {"mxfp8": "check_mxfp8_support", "blockwise": "check_fp8_block_scaling_support"}
    name = names.get(granularity, "check_fp8_support")
    for module in ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization"):
        try:
            mod = __import__(module, fromlist=[name])
            ok, reason = getattr(mod, name)()
            return bool(ok), str(reason)
        except (ImportError, AttributeError):
            continue
    return True, "TE has no capability check for this recipe; trying anyway"


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def check_linear(recipe, tokens=512, hidden=256, out=512, seed=0) -> dict:
    """Single GEMM: TE Linear vs emulated linear, forward and both gradients."""
    import torch
    import transformer_engine.pytorch as te
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_calibclip.fp8 import EmulatedColumnParallelLinear, set_precision, te_fp8_autocast

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(out, hidden, device="cuda", generator=g) * 0.05
    x = torch.randn(tokens, 1, hidden, device="cuda", generator=g)
    dy = torch.randn(tokens, 1, out, device="cuda", generator=g) * 1e-3

    te_lin = te.Linear(hidden, out, bias=False, params_dtype=torch.float32, device="cuda")
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                            use_cpu_initialization=True, gradient_accumulation_fusion=False)
    emu = EmulatedColumnParallelLinear(hidden, out, config=cfg, init_method=torch.nn.init.zeros_,
                                       bias=False, gather_output=False,
                                       tp_comm_buffer_name="fc1").cuda()
    with torch.no_grad():
        te_lin.weight.copy_(w)
        emu.weight.copy_(w)
    set_precision(emu, "fp8", recipe)
    result = {}
    steps = 3 if recipe.granularity == "delayed" else 1  # exercise the amax history
    for step in range(steps):
        xt, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        te_lin.weight.grad = None
        emu.weight.grad = None
        with te_fp8_autocast(recipe):
            yt = te_lin(xt)
        yt.backward(dy)
        ye, _ = emu(xe)
        ye.backward(dy)
        result[f"step{step}"] = {
            "output_rel_err": _rel(ye, yt),
            "dgrad_rel_err": _rel(xe.grad, xt.grad),
            "wgrad_rel_err": _rel(emu.weight.grad, te_lin.weight.grad),
        }
    worst = max(max(v.values()) for v in result.values())
    result["pass"] = worst <= 1e-3
    return result


_TE_RENAMES = {  # local-spec parameter -> TE-spec parameter (TE fuses the norm into the linear)
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _te_name(name: str) -> str:
    for old, new in _TE_RENAMES.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name


def _copy_weights(src, dst) -> None:
    import torch

    dst_params = dict(dst.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, p in src.named_parameters():
            target = _te_name(name)
            if target not in dst_params:
                raise KeyError(f"TE model has no parameter {target!r} (from {name!r})")
            dst_params[target].copy_(p)
            seen.add(target)
    missing = sorted(set(dst_params) - seen)
    if missing:
        raise KeyError(f"TE parameters not covered by the local model: {missing}")


def check_model(recipe, emu_model, cfg, tokens) -> dict:
    import torch

    from megatron_calibclip.fp8 import reset_fp8_state, set_precision, te_config_kwargs
    from megatron_calibclip.models import build_policy_model
    from megatron_calibclip.parallel import vocab_parallel_logprobs_entropy

    def logp(model):
        pos = torch.arange(tokens.shape[1], device="cuda").expand(tokens.shape[0], -1)
        logits = model(tokens, pos, None)
        return vocab_parallel_logprobs_entropy(logits[:, :-1].float(), tokens[:, 1:],
                                               true_vocab_size=cfg.vocab_size)[0]

    te_model = build_policy_model(cfg, backend="te", seed=0, use_cpu_initialization=True,
                                  **te_config_kwargs(recipe)).cuda()
    _copy_weights(emu_model, te_model)
    te_model.eval()
    emu_model.eval()
    out = {}
    with torch.no_grad():
        set_precision(te_model, "fp32")
        set_precision(emu_model, "fp32")
        te_hp, emu_hp = logp(te_model), logp(emu_model)
        set_precision(te_model, "fp8", recipe)
        set_precision(emu_model, "fp8", recipe)
        reset_fp8_state(emu_model)
        warmups = 2 if recipe.granularity == "delayed" else 0  # same history on both sides
        for _ in range(warmups):
            logp(te_model)
            logp(emu_model)
        te_fp8, emu_fp8 = logp(te_model), logp(emu_model)
    out["hp_gap_mean"] = (emu_hp - te_hp).abs().mean().item()
    out["fp8_effect_mean"] = (te_fp8 - te_hp).abs().mean().item()
    out["emu_vs_te_fp8_mean"] = (emu_fp8 - te_fp8).abs().mean().item()
    out["emu_vs_te_fp8_max"] = (emu_fp8 - te_fp8).abs().max().item()
    out["emu_fp8_effect_mean"] = (emu_fp8 - emu_hp).abs().mean().item()
    allowed = 0.25 * out["fp8_effect_mean"] + 2 * out["hp_gap_mean"]
    out["pass"] = out["emu_vs_te_fp8_mean"] <= allowed
    del te_model
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="emulated vs Transformer Engine FP8 log-probs")
    parser.add_argument("--granularities", nargs="+",
                        default=["tensorwise", "delayed", "blockwise", "mxfp8"])
    parser.add_argument("--formats", nargs="+", default=["e4m3", "hybrid"])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    reason = _unavailable()
    if reason is not None:
        print(f"fp8_device_check: cannot run: {reason}. Nothing was checked.", file=sys.stderr)
        return 2

    import torch

    from megatron_calibclip.fp8 import FP8Recipe, fp8_linear_classes
    from megatron_calibclip.models import build_policy_model, get_preset, local_layer_spec
    from megatron_calibclip.parallel import initialize_distributed

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    initialize_distributed()  # single process; megatron needs its groups
    cfg = get_preset("tiny", hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
                     num_query_groups=2, make_vocab_size_divisible_by=128)
    emu_model = build_policy_model(cfg, spec=local_layer_spec(cfg, **fp8_linear_classes()),
                                   seed=0, use_cpu_initialization=True).cuda()
    tokens = torch.randint(1, cfg.vocab_size, (4, 129),
                           generator=torch.Generator().manual_seed(0)).cuda()
    report = {"device": torch.cuda.get_device_name(),
              "capability": torch.cuda.get_device_capability(), "results": {}}
    failed = False
    for granularity in args.granularities:
        ok, why = _support(granularity)
        for fmt in args.formats:
            key = f"{fmt}/{granularity}"
            if not ok:
                report["results"][key] = {"skipped": why}
                continue
            recipe = FP8Recipe(format=fmt, granularity=granularity)
            try:
                res = {"linear": check_linear(recipe),
                       "model": check_model(recipe, emu_model, cfg, tokens)}
                res["pass"] = res["linear"]["pass"] and res["model"]["pass"]
            except Exception as err:  # noqa: BLE001 - report and continue with the next recipe
                res = {"error": f"{type(err).__name__}: {err}", "pass": False}
            failed |= not res["pass"]
            report["results"][key] = res
            print(f"{key}: {'PASS' if res['pass'] else 'FAIL'}", file=sys.stderr)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
