"""The FP8 noise probe: static log-prob error and importance-ratio noise per FP8 recipe.

Why: Calibrated Clipping exists because FP8 spreads the PPO ratio r = pi/pi_old far more than
BF16 does. This probe measures that spread on one model and one batch, for every recipe side
by side, with fp32 as the truth and BF16 beside FP8 (BF16 weight rounding is itself noisy
against fp32), separating the noise sources of the SPEC ("Where FP8 ratio noise comes from"):

- static: per-token |logp_fp8 - logp_bf16| (and each precision against fp32), bucketed by the
  token's fp32 probability;
- source "layout": same weights; old log-probs computed in one micro-batch layout (A:
  consecutive groups of `old_micro_batch`), current ones in another (B: groups of
  `micro_batch` after a seeded shuffle). Padding differs too (each micro-batch is right-padded
  to its own longest sequence). fp32, BF16 and per-token/per-tile recipes give r == 1 exactly;
  tensorwise and delayed scales couple a token to its neighbours (mechanism 2);
- source "update_lr<lr>": one small optimizer-like step on the master weights, then the
  current log-probs in layout A again (mechanism 1: FP8 weights re-quantized from the master
  weights at every forward; most of them do not move at RL learning rates, a few jump).

The update is Adam's first step on a synthetic policy-gradient loss: with bias correction,
Adam's first update is lr * m / sqrt(v) = lr * sign(g), so w <- w - lr * sign(g), where g is
the fp32 gradient of -sum_t A_t logp_t / n_tokens over layout A with the synthetic
advantages (every parameter moves by exactly lr, the direction a real step would take).

Synthetic advantages: each sequence gets A = -1 with probability `neg_frac`, else +1 (seeded),
for all of its tokens (GRPO-style sequence-level advantages). Reported per source and
precision: the std of log r against fp32's log r (and against BF16's), the lower-clip rate of
negative-advantage tokens (r < 1 - eps_low), the upper-clip rate of positive ones
(r > 1 + eps_high), and the phantom-clip rate: the fraction of negative-advantage tokens
whose ratio in this precision falls below 1 - eps_low while BF16's (or fp32's) does not.

Token samples (`tokens`): "chain_sum" = reasoning-gym chain_sum problems, question + " " +
answer, every position measured, with `corrupt` (5%) of the positions replaced by uniform
random ids as a stand-in for the unlikely tokens sampling produces; "samples" = chain_sum
questions followed by responses sampled from the model itself (fp32, KV-cached rollout
engine, temperature `temperature`), only the response tokens measured, as in RL; "random" =
uniform ids. Tokenised by bytes (id = byte + 3; pad 0, BOS 1, EOS 2; needs vocab >= 259), or
with the HF tokenizer (and chat template) of a `load`ed folder. A randomly initialised model
predicts every token with p ~ 1/vocab, so by default a random model of <= 10M parameters first
gets a short supervised warm-up (Adam, fp32) on other chain_sum problems, which gives it a
realistic spread of token probabilities (p ~ 1 on the fixed question text, lower on digits).

Runs single-process at TP=1 (inside an initialised model-parallel world).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import torch

from megatron_calibclip.parallel.devices import HOST, model_device
# re-exported: the probe's public names live here (tests, cli.py, probe/__init__.py)
from megatron_calibclip.probe.config import (  # noqa: F401
    BOS_ID,
    BYTE_OFFSET,
    DEFAULT_WARMUP_STEPS,
    EMULATIONS,
    EOS_ID,
    GRANULARITIES,
    PAD_ID,
    PROB_EDGES,
    SMALL_MODEL_PARAMS,
    TOKEN_SOURCES,
    ProbeConfig,
    ProbeError,
    parse_recipes,
)
from megatron_calibclip.probe.data import (  # noqa: F401
    _Tokens,
    make_layouts,
    make_samples,
    make_sequences,
)
from megatron_calibclip.probe.model import build_model, layout_logprobs, update_direction, warmup  # noqa: F401
from megatron_calibclip.probe.weights import (  # noqa: F401
    _changed_fraction,
    _gemm_weights,
    dither_weights,
    rounding_tie_fractions,
)


# ------------------------------------------------------------------------ statistics
def bucket_stats(p_ref: torch.Tensor, value: torch.Tensor,
                 edges: Sequence[float] = PROB_EDGES) -> dict[str, Any]:
    """Mean and median of `value` per probability bucket [edges[i], edges[i+1]) (the last
    bucket includes 1.0), plus counts and the overall mean."""
    p, v = p_ref.double().flatten(), value.double().flatten()
    means, medians, counts = [], [], []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        last = i == len(edges) - 2
        sel = (p >= lo) & ((p <= hi) if last else (p < hi))
        n = int(sel.sum())
        counts.append(n)
        means.append(float(v[sel].mean()) if n else None)
        medians.append(float(v[sel].median()) if n else None)
    return {"mean": means, "median": medians, "count": counts, "all_mean": float(v.mean())}


def ratio_stats(log_r: torch.Tensor, log_r_bf16: torch.Tensor, log_r_fp32: torch.Tensor,
                adv: torch.Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """Ratio noise and clip rates of one precision for one source (all per-token tensors).

    A token is lower-clipped when r < 1 - eps_low (counted over A < 0) and upper-clipped when
    r > 1 + eps_high (over A > 0); phantom_vs_X = P(r < 1 - eps_low and r_X >= 1 - eps_low |
    A < 0): clipped here but not in the reference precision X."""
    lr, r16, r32 = log_r.double(), log_r_bf16.double(), log_r_fp32.double()
    neg, pos = adv < 0, adv > 0
    lo = 1.0 - eps_low
    clipped = torch.exp(lr) < lo
    n_neg, n_pos = max(int(neg.sum()), 1), max(int(pos.sum()), 1)

    def frac(mask: torch.Tensor, of: torch.Tensor, n: int) -> float:
        return float((mask & of).sum()) / n

    return {
        "noise_std_vs_fp32": float((lr - r32).std(unbiased=False)),
        "noise_mean_abs_vs_fp32": float((lr - r32).abs().mean()),
        "noise_std_vs_bf16": float((lr - r16).std(unbiased=False)),
        "log_ratio_std": float(lr.std(unbiased=False)),
        "ratio_ne_1_frac": float((lr != 0).double().mean()),
        "clip_low_rate_neg": frac(clipped, neg, n_neg),
        "clip_high_rate_pos": frac(torch.exp(lr) > 1.0 + eps_high, pos, n_pos),
        "phantom_vs_bf16": frac(clipped & ~(torch.exp(r16) < lo), neg, n_neg),
        "phantom_vs_fp32": frac(clipped & ~(torch.exp(r32) < lo), neg, n_neg),
    }


# ------------------------------------------------------------------------ the probe
def _source_name(lr: float) -> str:
    return f"update_lr{lr:g}"


def run_fp8_noise(cfg: ProbeConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the probe (TP=1, model-parallel world initialised); returns the JSON-ready result."""
    from megatron.core import parallel_state

    from megatron_calibclip.fp8 import FP8Recipe, reset_fp8_state, set_precision

    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise ProbeError("the fp8-noise probe runs at TP=1 (one process)")
    t0 = time.perf_counter()
    timing: dict[str, float] = {}
    torch.manual_seed(cfg.seed)
    model, mcfg, tokenizer, model_info = build_model(cfg, log)
    vocab = mcfg.vocab_size
    pad_id = tokenizer.pad_id if tokenizer is not None else PAD_ID
    if cfg.tokens != "random":
        _Tokens(vocab, tokenizer)  # fail early: byte tokens need a vocabulary >= 259
    timing["build"] = time.perf_counter() - t0

    random_weights = cfg.load is None
    steps = cfg.warmup_steps
    if steps is None:
        steps = DEFAULT_WARMUP_STEPS if random_weights and \
            mcfg.num_parameters() <= SMALL_MODEL_PARAMS else 0
    set_precision(model, "fp32")
    warm = {"steps": steps, "lr": cfg.warmup_lr, "loss_first": None, "loss_last": None}
    if steps > 0:
        t = time.perf_counter()
        train = make_sequences(cfg, 4 * cfg.num_seqs, cfg.seed + 1000, vocab, tokenizer,
                               eos=cfg.tokens == "samples")
        losses = warmup(model, train, cfg, steps, vocab, pad_id)
        warm.update(loss_first=losses[0], loss_last=losses[-1])
        timing["warmup"] = time.perf_counter() - t
        log(f"warm-up: {steps} Adam steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.eval()

    corrupt = cfg.corrupt if cfg.tokens == "chain_sum" else 0.0
    if cfg.tokens == "samples":
        t = time.perf_counter()
        with torch.no_grad():
            seqs, starts = make_samples(model, cfg, cfg.num_seqs, cfg.seed, vocab, tokenizer)
        timing["sampling"] = time.perf_counter() - t
    else:
        seqs = make_sequences(cfg, cfg.num_seqs, cfg.seed, vocab, tokenizer, corrupt)
        starts = [1] * len(seqs)
    if len(seqs) < 2:
        raise ProbeError("fewer than 2 usable sequences (length >= 2); raise num_seqs/max_len")
    layout_a, layout_b = make_layouts(len(seqs), cfg.old_micro_batch, cfg.micro_batch, cfg.seed)
    # measured positions: next-token position t scores token t + 1; a sequence's tokens from
    # index starts[i] on are measured (text: all but the first token; samples: the response)
    dev = model_device(model)  # where the log-probs these select and weight live
    measured = torch.cat([torch.arange(len(s) - 1, device=dev) >= starts[i] - 1
                          for i, s in enumerate(seqs)])
    g = torch.Generator(device=HOST).manual_seed(cfg.seed + 3)
    draws = torch.rand(len(seqs), generator=g, device=HOST).to(dev)
    seq_adv = torch.where(draws < cfg.neg_frac, -1.0, 1.0)
    adv_all = torch.cat([seq_adv[i].expand(len(s) - 1) for i, s in enumerate(seqs)])
    adv_all = torch.where(measured, adv_all, torch.zeros_like(adv_all))
    adv = adv_all[measured]

    t = time.perf_counter()
    direction = update_direction(model, seqs, layout_a, adv_all, vocab, pad_id)
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    timing["direction"] = time.perf_counter() - t

    def apply_update(lr: float) -> None:
        with torch.no_grad():
            for n, d in direction.items():
                params[n].copy_(master[n] - lr * d)

    def restore() -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(master[n])

    weights, activations = EMULATIONS[cfg.emulation]
    options = dict(weight_source=weights, activation_precision=activations)
    precisions = [("fp32", "fp32", None), ("bf16", "bf16", FP8Recipe(**options))] + [
        (gname, "fp8", FP8Recipe(granularity=gname, **options)) for gname in cfg.recipes]
    logp: dict[str, dict[str, torch.Tensor]] = {}
    changed: dict[str, dict[str, float]] = {_source_name(lr): {} for lr in cfg.lrs}
    with torch.no_grad():
        for key, mode, recipe in precisions:
            t = time.perf_counter()
            set_precision(model, mode, recipe)
            reset_fp8_state(model)
            if recipe is not None and recipe.granularity == "delayed":
                # scales come from earlier steps: fill the amax history with this batch first
                layout_logprobs(model, seqs, layout_a, vocab, pad_id)
            def run(layout):
                return layout_logprobs(model, seqs, layout, vocab, pad_id)[measured]

            res = {"old": run(layout_a), "layout": run(layout_b)}
            before = _gemm_weights(model, mode)
            for lr in cfg.lrs:
                apply_update(lr)
                changed[_source_name(lr)][key] = _changed_fraction(before, _gemm_weights(model,
                                                                                         mode))
                res[_source_name(lr)] = run(layout_a)
                restore()
            logp[key] = res
            timing[key] = time.perf_counter() - t
        set_precision(model, "fp32")

    # ---- statistics
    lp32, lp16 = logp["fp32"]["old"], logp["bf16"]["old"]
    p_ref = torch.exp(lp32.double())
    static: dict[str, Any] = {
        "bf16": {"vs_fp32": bucket_stats(p_ref, (lp16 - lp32).abs()),
                 "err_std_vs_fp32": float((lp16 - lp32).double().std(unbiased=False))}}
    for key in cfg.recipes:
        lp8 = logp[key]["old"]
        static[key] = {"vs_bf16": bucket_stats(p_ref, (lp8 - lp16).abs()),
                       "vs_fp32": bucket_stats(p_ref, (lp8 - lp32).abs()),
                       "err_std_vs_fp32": float((lp8 - lp32).double().std(unbiased=False))}
    sources: dict[str, Any] = {}
    for src in ["layout"] + [_source_name(lr) for lr in cfg.lrs]:
        log_r = {key: logp[key][src] - logp[key]["old"] for key in logp}
        sources[src] = {key: ratio_stats(log_r[key], log_r["bf16"], log_r["fp32"], adv,
                                         cfg.eps_low, cfg.eps_high) for key in log_r}
    timing["total"] = time.perf_counter() - t0
    labels = [f"[{lo:g}, {hi:g}{']' if i == len(PROB_EDGES) - 2 else ')'}"
              for i, (lo, hi) in enumerate(zip(PROB_EDGES[:-1], PROB_EDGES[1:]))]
    return {
        "probe": "fp8-noise",
        "config": dataclasses.asdict(cfg),
        "model": model_info,
        "data": {
            "tokens": {
                "chain_sum": "reasoning-gym chain_sum question + answer text, all positions",
                "samples": f"reasoning-gym chain_sum questions + responses sampled from the "
                           f"model (fp32, T={cfg.temperature:g}, <= {cfg.sample_len} tokens); "
                           f"response tokens only",
                "random": "uniform random token ids"}[cfg.tokens],
            "tokenizer": "none" if cfg.tokens == "random" else
            ("the HF folder's tokenizer" if tokenizer is not None else
             f"bytes (id = byte + {BYTE_OFFSET}, pad {PAD_ID}, BOS {BOS_ID}, EOS {EOS_ID})"),
            "corrupted_frac": corrupt,
            "num_seqs": len(seqs),
            "num_tokens": int(adv.numel()),
            "num_neg_tokens": int((adv < 0).sum()),
            "seq_len_min": min(len(s) for s in seqs),
            "seq_len_max": max(len(s) for s in seqs),
            "layout_old_micro_batches": [len(mb) for mb in layout_a],
            "layout_new_micro_batches": [len(mb) for mb in layout_b],
            "padding": "right, to each micro-batch's longest sequence",
        },
        "warmup": warm,
        "update": {"rule": "w <- w - lr * sign(grad): Adam's first step on the fp32 gradient "
                           "of -sum(A * logp) / n_tokens (layout A)", "lrs": list(cfg.lrs)},
        "prob_buckets": {"edges": list(PROB_EDGES), "labels": labels,
                         "by": "the token's fp32 probability (old weights, layout A)",
                         "count": bucket_stats(p_ref, p_ref)["count"]},
        "static": static,
        "sources": sources,
        "gemm_weights_changed_frac": changed,
        "timing_s": {k: round(v, 3) for k, v in timing.items()},
    }
