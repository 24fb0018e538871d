"""Cost and noise of the precision emulation, measured side by side in one run; prints JSON.

Per model (the tiny preset and a mid-size one) and per mode (fp32 = megatron's own GEMM,
emulated bf16, emulated FP8 per granularity): time per forward (no grad) and per
forward+backward, interleaved round-robin across modes, best-of and median; the mean
|log-prob error| against fp32; and the two FP8 noise mechanisms
of SPEC-calibrated-clipping.md measured on a fixed sequence:
  * batch_coupling: max |dlogp| of the same sequence batched with a different neighbour;
  * perturbation_noise: std of dlogp after a random 1e-6 relative nudge of the embedding
    (an update too small to matter in fp32: rounding decisions are re-rolled downstream).
Plus one 1024^2 GEMM: fp32, native CPU bf16, emulated bf16, emulated FP8 per granularity.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/fp8/bench_emulation.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import warnings

import torch

warnings.filterwarnings("ignore")

from megatron_calibclip.fp8 import (  # noqa: E402
    FP8Recipe,
    fp8_linear_classes,
    quantize_dequantize,
    reset_fp8_state,
    set_precision,
)
from megatron_calibclip.bench.timing import interleaved_times  # noqa: E402
from megatron_calibclip.fp8.formats import round_to_bf16  # noqa: E402
from megatron_calibclip.models import build_policy_model, get_preset, local_layer_spec  # noqa: E402
from megatron_calibclip.parallel import (  # noqa: E402
    initialize_distributed,
    vocab_parallel_logprobs_entropy,
)

GRANULARITIES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")


def _logp(model, cfg, tokens):
    pos = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    logits = model(tokens, pos, None)
    return vocab_parallel_logprobs_entropy(logits[:, :-1], tokens[:, 1:],
                                           true_vocab_size=cfg.vocab_size)[0]


def _fresh_logp(model, cfg, tokens):
    """Log-probs after a reset and one warm-up forward on the same batch (delayed scaling
    then uses this batch's amaxes; the other recipes are stateless)."""
    reset_fp8_state(model)
    _logp(model, cfg, tokens)
    return _logp(model, cfg, tokens)


def bench_model(name, cfg, batch, seq, rounds):
    plain = build_policy_model(cfg, seed=0)
    model = build_policy_model(cfg, spec=local_layer_spec(cfg, **fp8_linear_classes()), seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, cfg.vocab_size, (batch, seq), generator=g)
    other = torch.randint(1, cfg.vocab_size, (batch, seq), generator=g)
    other[0] = tokens[0]  # same first sequence, different neighbours
    emb = model.embedding.word_embeddings.weight
    nudge = emb.detach().abs() * 1e-6 * torch.randn(emb.shape, generator=g)
    pos = torch.arange(seq).expand(batch, -1)
    modes = {"fp32": ("fp32", None), "bf16": ("bf16", None)}
    modes.update({f"fp8_{gr}": ("fp8", FP8Recipe(format="hybrid", granularity=gr))
                  for gr in GRANULARITIES})
    rows = {}
    with torch.no_grad():
        ref = _logp(model, cfg, tokens)
        for key, (mode, recipe) in modes.items():
            set_precision(model, mode, recipe)
            lp = _fresh_logp(model, cfg, tokens)
            lp_other = _fresh_logp(model, cfg, other)
            emb.add_(nudge)
            lp_nudged = _fresh_logp(model, cfg, tokens)
            emb.sub_(nudge)
            rows[key] = {
                "mean_abs_logp_err_vs_fp32": (lp - ref).abs().mean().item(),
                "batch_coupling_max_abs_dlogp": (lp[0] - lp_other[0]).abs().max().item(),
                "perturbation_noise_std_dlogp": (lp_nudged - lp).std().item(),
            }

    def forward(mode, recipe):
        def run():
            set_precision(model, mode, recipe)
            with torch.no_grad():
                _logp(model, cfg, tokens)
        return run

    def forward_backward(mode, recipe):
        def run():
            set_precision(model, mode, recipe)
            model.zero_grad()
            (-_logp(model, cfg, tokens).mean()).backward()
        return run

    fwd = {"fp32_plain_megatron": lambda: plain(tokens, pos, None).sum().item()}
    fwd.update({k: forward(*v) for k, v in modes.items()})
    fwd_t = interleaved_times(fwd, rounds)
    bwd_t = interleaved_times({k: forward_backward(*v) for k, v in modes.items()},
                               max(2, rounds // 2))
    base = fwd_t["fp32"]["min_s"]
    for key, t in fwd_t.items():
        row = rows.setdefault(key, {})
        row["forward"] = t
        row["forward_min_vs_fp32"] = t["min_s"] / base
        if key in bwd_t:
            row["forward_backward"] = bwd_t[key]
    set_precision(model, "fp32")
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "parameters": params, "batch": batch, "seq": seq, "modes": rows}


def bench_gemm(n, rounds):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a16, b16 = a.bfloat16(), b.bfloat16()
    fns = {
        "fp32": lambda: a @ b.t(),
        "native_bf16": lambda: a16 @ b16.t(),
        "emulated_bf16": lambda: round_to_bf16(round_to_bf16(a) @ round_to_bf16(b).t()),
    }
    for gr in GRANULARITIES:
        if gr == "delayed":
            continue  # same arithmetic as tensorwise, plus a history update
        r = FP8Recipe(granularity=gr)
        fns[f"emulated_fp8_{gr}"] = (
            lambda r=r: quantize_dequantize(a, r) @ quantize_dequantize(b, r, "weight").t())
    t = interleaved_times(fns, rounds)
    return {"shape": [n, n, n], **t,
            "native_bf16_min_over_emulated_bf16_min":
                t["native_bf16"]["min_s"] / t["emulated_bf16"]["min_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, tiny model only")
    args = parser.parse_args()
    rounds = 3 if args.quick else 9
    initialize_distributed()  # single process (gloo); megatron needs its groups
    mid = get_preset("tiny", num_layers=4, hidden_size=512, ffn_hidden_size=1536,
                     num_attention_heads=8, num_query_groups=4, vocab_size=8000)
    results = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cpu_flags_bf16": "avx512_bf16" in open("/proc/cpuinfo").read(),
        "load_average_at_start": list(os.getloadavg()),
        "gemm": bench_gemm(1024, rounds),
        "models": [bench_model("tiny", get_preset("tiny"), batch=4, seq=128, rounds=rounds)],
    }
    if not args.quick:
        results["models"].append(bench_model("mid-4x512", mid, batch=4, seq=256, rounds=rounds))
    results["load_average_at_end"] = list(os.getloadavg())
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
