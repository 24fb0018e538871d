"""Whole-model FP8 properties: TP=2 vs TP=1, gradients in hybrid mode, the exact BF16 switch.

Numbers quoted in comments were measured on this CPU emulation (seeded, deterministic).
"""
import pytest
import torch

from megatron_calibclip.fp8 import FP8Recipe

GRANULARITIES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "delayed")


def _build(cfg, seed=0):
    from megatron_calibclip.fp8 import fp8_linear_classes
    from megatron_calibclip.models import build_policy_model, local_layer_spec

    return build_policy_model(cfg, spec=local_layer_spec(cfg, **fp8_linear_classes()), seed=seed)


def _tokens(b, s, seed):
    return torch.randint(1, 1000, (b, s), generator=torch.Generator().manual_seed(seed))


def _logp(model, cfg, tokens):
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    return shifted_logprobs_entropy(forward_logits(model, tokens), tokens, cfg.vocab_size)[0]


# ----------------------------------------------------------------------------- TP=2 vs TP=1
def _tp_body(rank, world_size):
    from megatron_calibclip.fp8 import reset_fp8_state, set_precision
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel

    # Every shard boundary on a multiple of 128: hidden 256 (activation tiles of the column
    # linears), per-rank q/proj width 2 heads x 64 = 128, per-rank fc1 gate/up and fc2 input
    # 256 / 2 = 128, and each KV group's [q, q, k, v] rows = 256 (qkv row blocks).
    cfg = get_preset("tiny", hidden_size=256, ffn_hidden_size=256)
    tokens = _tokens(3, 40, seed=1)
    # activation_precision "fp32": GEMM operands only, so that the only other TP effect (each
    # row-parallel rank's bf16 partial output, rounded before the all-reduce as on a GPU)
    # does not hide whether the quantizer's scales are shard-invariant; the default bf16
    # stack is measured as "fp8-bf16-stack" below
    modes = [("fp32", None), ("bf16", None)] + [
        ("fp8", FP8Recipe(format="hybrid", granularity=g, amax_history_len=4,
                          activation_precision="fp32"))
        for g in GRANULARITIES] + [("fp8", FP8Recipe(format="hybrid", granularity="blockwise"))]
    lp = {}
    for tp in (1, 2):
        with model_parallel(tp=tp):  # TP=1: both ranks hold the whole model (DP=2)
            model = _build(cfg)
            with torch.no_grad():
                for mode, recipe in modes:
                    set_precision(model, mode, recipe)
                    reset_fp8_state(model)
                    key = mode if recipe is None else recipe.granularity
                    if recipe is not None and recipe.activation_precision == "bf16":
                        key = "fp8-bf16-stack"
                    if key == "delayed":
                        _logp(model, cfg, tokens)  # scales from this batch's amaxes
                    lp[(tp, key)] = _logp(model, cfg, tokens)
    out = {}
    for key in [k for t, k in lp if t == 1]:
        d = (lp[(1, key)] - lp[(2, key)]).abs()
        out[key] = {"max": d.max().item(), "mean": d.mean().item(),
                    "err_vs_fp32": (lp[(1, key)] - lp[(1, "fp32")]).abs().mean().item()}
    return out


@pytest.mark.dist
def test_fp8_model_tp2_equals_tp1_where_the_recipe_is_shard_invariant(dist_pool):
    """Measured max / mean |logp(TP=1) - logp(TP=2)| (FP8 error vs fp32 in brackets):
    fp32 9.5e-7 / 3e-8; blockwise, mxfp8 9.5e-7 / 6e-8 [0.0145]; delayed (amax reduced over
    the amax group) 9.5e-7 / 7e-8 [0.015] -- only fp32 accumulation order differs (row-
    parallel partial sums + all-reduce). tensorwise 0.049 / 0.013 [0.014] and rowwise
    0.041 / 0.012 [0.013]: the documented deviation, as large as the FP8 error itself, since
    each rank scales its own shard (tensorwise: weight and row-parallel input amax per shard;
    rowwise: row-parallel lines are half as long). bf16 (the whole bf16 stack) 0.0041 / 0.0013:
    each rank's partial output is rounded to bf16 before the all-reduce, as a BF16 GEMM's
    output is on GPU; blockwise FP8 in the bf16 stack 0.016 / 0.0056 (those partial-sum
    roundings, amplified where they flip an FP8 code)."""
    res = dist_pool(2).run(_tp_body)[0]
    assert res["fp32"]["max"] < 1e-5, res["fp32"]
    for invariant in ("blockwise", "mxfp8", "delayed"):
        assert res[invariant]["max"] < 1e-5, (invariant, res[invariant])
        assert res[invariant]["err_vs_fp32"] > 5e-3  # while FP8 error itself is large
    for coupled in ("tensorwise", "rowwise"):
        r = res[coupled]
        assert 3e-3 < r["mean"] < 0.05 and r["max"] > 0.01, (coupled, r)
        assert 0.5 < r["mean"] / r["err_vs_fp32"] < 1.5, (coupled, r)  # FP8-sized deviation
    assert 1e-4 < res["bf16"]["mean"] < 3e-3, res["bf16"]
    assert 1e-3 < res["fp8-bf16-stack"]["mean"] < 0.5 * res["tensorwise"]["mean"], res


# ----------------------------------------------------------- gradients + the precision switch
def _switch_body(rank, world_size, tp):
    from megatron_calibclip.fp8 import get_precision, precision, reset_fp8_state, set_precision
    from megatron_calibclip.models import copy_weights, get_preset
    from megatron_calibclip.parallel import model_parallel

    out = {}
    cfg = get_preset("tiny")
    tokens = _tokens(4, 48, seed=3)
    with model_parallel(tp=tp):
        model = _build(cfg)

        def grads():
            model.zero_grad(set_to_none=True)
            (-_logp(model, cfg, tokens).mean()).backward()
            return {n: p.grad.detach().clone() if p.grad is not None else None
                    for n, p in model.named_parameters()}

        set_precision(model, "fp32")
        g32 = grads()
        stats = {}
        for fmt in ("hybrid", "e4m3"):
            for g in (GRANULARITIES if fmt == "hybrid" else ("blockwise",)):
                set_precision(model, "fp8", FP8Recipe(format=fmt, granularity=g))
                reset_fp8_state(model)
                if g == "delayed":
                    grads()  # the first delayed backward runs at scale 1 (TE's start)
                gq = grads()
                finite = all(v is not None and torch.isfinite(v).all() for v in gq.values())
                nonzero = all(v is not None and v.abs().sum() > 0 for v in gq.values())
                cos = min(torch.nn.functional.cosine_similarity(
                    gq[n].flatten(), g32[n].flatten(), dim=0).item() for n in gq)
                rel = max(((gq[n] - g32[n]).norm() / g32[n].norm()).item() for n in gq)
                stats[f"{fmt}:{g}"] = (finite, nonzero, cos, rel)
        out["grads"] = stats

        # Move the weights off their seeded values, so "same weights" means the live ones.
        with torch.no_grad():
            gen = torch.Generator().manual_seed(100 + rank % tp)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        recipe = FP8Recipe(format="hybrid", granularity="tensorwise")
        set_precision(model, "fp8", recipe)
        with torch.no_grad():
            lp8 = _logp(model, cfg, tokens)
            with precision(model, "bf16") as state:
                out["inside"] = state.mode
                lp16 = _logp(model, cfg, tokens)
            out["fp8_restored_bitwise"] = torch.equal(_logp(model, cfg, tokens), lp8)
            after = get_precision(model)
            out["restored_state"] = after.mode == "fp8" and after.recipe is recipe
            try:
                with precision(model, "bf16"):
                    _logp(model, cfg, tokens)
                    raise RuntimeError("failure inside the shadow pass")
            except RuntimeError:
                pass
            after = get_precision(model)
            out["restored_after_error"] = after.mode == "fp8" and after.recipe is recipe
            out["fp8_after_error_bitwise"] = torch.equal(_logp(model, cfg, tokens), lp8)
            # A model built from scratch (other seed), given the same weights, run in bf16.
            fresh = _build(cfg, seed=7)
            copy_weights(model, fresh)
            set_precision(fresh, "bf16")
            fresh16 = _logp(fresh, cfg, tokens)
            out["shadow_equals_fresh_bf16"] = torch.equal(lp16, fresh16)
            out["bf16_differs_from_fp8"] = (lp16 - lp8).abs().mean().item()
            set_precision(fresh, "fp32")
            out["bf16_vs_fp32"] = (lp16 - _logp(fresh, cfg, tokens)).abs().mean().item()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_gradients_and_exact_bf16_switch(dist_pool, tp):
    for rank, res in enumerate(dist_pool(2).run(_switch_body, tp)):
        # Measured (TP=1; TP=2 within 0.02): min cosine to the fp32 gradient over all
        # parameters / max relative error: hybrid tensorwise 0.995 / 0.10, rowwise 0.994 /
        # 0.11, blockwise and mxfp8 0.991 / 0.14, delayed 0.993 / 0.12; e4m3 blockwise 0.996
        # / 0.094 (E5M2 gradients carry one mantissa bit less). Worst: the RMSNorm weights.
        for key, (finite, nonzero, cos, rel) in res["grads"].items():
            assert finite and nonzero, (rank, key)
            assert cos > 0.985 and rel < 0.2, (rank, key, cos, rel)
        assert res["grads"]["hybrid:blockwise"][3] > res["grads"]["e4m3:blockwise"][3]
        assert res["inside"] == "bf16"
        assert res["shadow_equals_fresh_bf16"], "BF16 shadow != a fresh bf16 model, same weights"
        assert res["fp8_restored_bitwise"] and res["restored_state"]
        assert res["restored_after_error"] and res["fp8_after_error_bitwise"]
        assert res["bf16_differs_from_fp8"] > 1e-3 and 0 < res["bf16_vs_fp32"] < 2e-3, res
