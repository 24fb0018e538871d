"""Study: which upper-bound rule should Calibrated Clipping use by default?

Runs the product's `compute_calibrated_bounds` (single process, widen_only off so each rule's
own H shows, the default guards otherwise) with every `upper_rule` on

* a Gaussian model of one calibration's tokens: log r16 ~ N(0, s16^2) per token, FP8 adds
  independent N(0, s8^2) (optionally noisier on negative-advantage tokens, which are the
  low-probability, noisiest ones), advantages +-1 in equal numbers; across FP8 noise levels,
  sample sizes and the GRPO / DAPO clip ranges, `--trials` draws per cell;
* calibration inputs recorded from real SmolLM2-135M runs (`--recorded`, files written by
  `clipping.calibration.record_dir`, compacted to npz by `--compact`).

Per rule it reports the spread of H (p5/p50/p95 over successful calibrations), how often it
is infinite / out of range or falls back (with reasons), and how close FP8 with the bounds
comes to what BF16 does with the host's [1 - eps_low, 1 + eps_high]: the clip fraction of
negative- and positive-advantage tokens and the ratio of kept (unclipped) positive to
negative mass (sum |A| r). On the model these are measured on a fresh held-out sample (the
bounds of one calibration act on later tokens); on recorded inputs, on the same tokens.
A fallback applies the host's bounds (what a first calibration that falls back does).

Run:  .venv/bin/python benchmarks/calibration/bench_upper_rules.py [--trials 100] [--quick]
Prints one JSON document on stdout (docs/calibration.md quotes it).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections import Counter

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from megatron_calibclip.calibration import compute_calibrated_bounds  # noqa: E402
from megatron_calibclip.calibration.config import UPPER_RULES  # noqa: E402

CLIP_RANGES = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28)}
HELD_OUT = 50_000


def _draw(rng: np.random.Generator, n: int, s16: float, s8: float, s8_neg: float):
    """(log r8, log r16, advantages) of n tokens, half with A = -1, half with A = +1."""
    adv = np.where(np.arange(n) % 2 == 0, -1.0, 1.0)
    lr16 = rng.normal(0.0, s16, n)
    lr8 = lr16 + rng.normal(0.0, 1.0, n) * np.where(adv < 0, s8_neg, s8)
    return lr8, lr16, adv


def _behaviour(lr8, lr16, adv, lower, upper, eps_low, eps_high) -> dict[str, float]:
    """Clip fractions by advantage sign and kept +/- mass, FP8 with [L, H] vs BF16 with eps."""
    neg, pos = adv < 0, adv > 0
    r8, r16 = np.exp(lr8), np.exp(lr16)
    lo16, hi16 = 1.0 - eps_low, 1.0 + eps_high

    def kept_ratio(r, lo, hi):
        kept_pos = np.sum(np.abs(adv[pos]) * r[pos] * (r[pos] <= hi))
        kept_neg = np.sum(np.abs(adv[neg]) * r[neg] * (r[neg] > lo))
        return kept_pos / kept_neg if kept_neg > 0 else math.inf

    return {
        "neg_clip_fp8": float(np.mean(r8[neg] <= lower)), "neg_clip_bf16": float(np.mean(r16[neg] <= lo16)),
        "pos_clip_fp8": float(np.mean(r8[pos] > upper)), "pos_clip_bf16": float(np.mean(r16[pos] > hi16)),
        "kept_mass_ratio_vs_bf16": kept_ratio(r8, lower, upper) / kept_ratio(r16, lo16, hi16),
    }


def _calibrate(lr8, lr16, adv, eps_low, eps_high, rule: str, min_clipped: int):
    t = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731  (the trainer's dtype)
    return compute_calibrated_bounds(t(lr8), t(lr16), t(adv), torch.ones(len(adv), dtype=torch.bool),
                                     eps_low, eps_high, upper_rule=rule, widen_only=False,
                                     min_clipped_tokens=min_clipped)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _summarise(results, behaviours) -> dict:
    """One rule on one cell: H spread, failure rates, and behaviour gaps to BF16."""
    n = len(results)
    ok_h = [r.upper for r in results if r.ok]
    raw_h = [math.exp(r.log_upper_raw) if r.log_upper_raw is not None else None for r in results]
    reasons = Counter(r.reason_code for r in results if not r.ok)
    inf_or_range = sum(reasons.get(c, 0) for c in ("upper_infeasible", "upper_out_of_range"))
    gaps = {key: [abs(b[f"{key}_fp8"] - b[f"{key}_bf16"]) for b in behaviours]
            for key in ("neg_clip", "pos_clip")}
    kept = [b["kept_mass_ratio_vs_bf16"] for b in behaviours]
    return {
        "H_p5": _pct(ok_h, 5), "H_p50": _pct(ok_h, 50), "H_p95": _pct(ok_h, 95),
        "H_raw_inf_rate": sum(1 for h in raw_h if h is not None and not math.isfinite(h)) / n,
        "upper_infeasible_or_out_of_range_rate": inf_or_range / n,
        "fallback_rate": sum(reasons.values()) / n,
        "fallback_reasons": dict(reasons),
        "L_p50": _pct([r.lower for r in results if r.ok], 50),
        "neg_clip_gap_to_bf16_mean": float(np.mean(gaps["neg_clip"])),
        "pos_clip_gap_to_bf16_mean": float(np.mean(gaps["pos_clip"])),
        "kept_mass_ratio_vs_bf16_p5": _pct(kept, 5), "kept_mass_ratio_vs_bf16_p50": _pct(kept, 50),
        "kept_mass_ratio_vs_bf16_p95": _pct(kept, 95),
    }


def _bounds_used(result, eps_low, eps_high) -> tuple[float, float]:
    return (result.lower, result.upper) if result.ok else (1.0 - eps_low, 1.0 + eps_high)


def gaussian_cells(quick: bool):
    s8s = (0.1, 0.25) if quick else (0.05, 0.1, 0.25)
    sizes = (1024, 4096) if quick else (256, 1024, 4096, 16384)
    for clip in CLIP_RANGES:
        for s16 in (0.1, 0.15):
            for s8 in s8s:
                for n in sizes:
                    yield {"clip": clip, "s16": s16, "s8": s8, "s8_neg": s8, "n": n}
    for s8 in s8s[-2:]:  # negatives noisier than positives (x1.5)
        yield {"clip": "grpo", "s16": 0.15, "s8": s8, "s8_neg": 1.5 * s8, "n": sizes[-1]}


def study_gaussian(trials: int, min_clipped: int, quick: bool, seed: int) -> list[dict]:
    out = []
    for cell_index, cell in enumerate(gaussian_cells(quick)):
        eps_low, eps_high = CLIP_RANGES[cell["clip"]]
        rng = np.random.default_rng(seed + cell_index)
        held = _draw(rng, HELD_OUT, cell["s16"], cell["s8"], cell["s8_neg"])
        samples = [_draw(rng, cell["n"], cell["s16"], cell["s8"], cell["s8_neg"]) for _ in range(trials)]
        rules = {}
        for rule in UPPER_RULES:
            results = [_calibrate(*s, eps_low, eps_high, rule, min_clipped) for s in samples]
            behaviours = [_behaviour(*held, *_bounds_used(r, eps_low, eps_high), eps_low, eps_high)
                          for r in results]
            rules[rule] = _summarise(results, behaviours)
        out.append({**cell, "eps_low": eps_low, "eps_high": eps_high, "trials": trials, "rules": rules})
        print(f"cell {cell_index + 1}: {cell}", file=sys.stderr, flush=True)
    return out


def compact(record_dir: str, out_npz: str) -> int:
    """Recorded calibration inputs -> one small npz of valid tokens, one entry per calibration.

    The recorder writes one file per data-parallel rank (stepNNNNNN_rankNNN.pt); a calibration
    pools its DP ranks, so the files of one step are concatenated. Returns the step count."""
    by_step: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(record_dir, "step*_rank*.pt"))):
        by_step.setdefault(os.path.basename(path).split("_rank")[0], []).append(path)
    arrays = {}
    for name, paths in by_step.items():
        parts = {k: [] for k in ("logratio_fp8", "logratio_shadow", "advantages")}
        for path in paths:
            rec = torch.load(path, weights_only=False)
            for mb in rec["minibatches"]:
                m = mb["mask"].bool()
                for k in parts:
                    parts[k].append(mb[k][m].float().numpy())
        for k, v in parts.items():
            arrays[f"{name}/{k}"] = np.concatenate(v).astype(np.float32)
        arrays[f"{name}/eps"] = np.array([rec["eps_low"], rec["eps_high"]], dtype=np.float64)
    np.savez_compressed(out_npz, **arrays)
    return len(by_step)


def study_recorded(paths: list[str], min_clipped: int) -> list[dict]:
    out = []
    for path in paths:
        data = np.load(path)
        for name in sorted({k.split("/")[0] for k in data.files}):
            lr8, lr16, adv = (data[f"{name}/{k}"].astype(np.float64)
                              for k in ("logratio_fp8", "logratio_shadow", "advantages"))
            eps_low, eps_high = (float(x) for x in data[f"{name}/eps"])
            rules = {}
            for rule in UPPER_RULES:
                r = _calibrate(lr8, lr16, adv, eps_low, eps_high, rule, min_clipped)
                b = _behaviour(lr8, lr16, adv, *_bounds_used(r, eps_low, eps_high), eps_low, eps_high)
                rules[rule] = {"L": r.lower, "H": r.upper, "reason": r.reason_code,
                               "H_raw": None if r.log_upper_raw is None else math.exp(r.log_upper_raw),
                               "alpha": r.alpha, "beta": r.beta, **b}
            out.append({"file": os.path.basename(path), "calibration": name, "n_neg": int((adv < 0).sum()),
                        "n_pos": int((adv > 0).sum()),
                        "k_neg_bf16": int(((adv < 0) & (lr16 <= math.log1p(-eps_low))).sum()),
                        "k_pos_bf16": int(((adv > 0) & (lr16 > math.log1p(eps_high))).sum()),
                        "rules": rules})
    return out


def _json_safe(value):
    """JSON has no inf/NaN: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--min-clipped", type=int, default=20, help="min_clipped_tokens for every rule")
    p.add_argument("--quick", action="store_true", help="a small grid (for tests)")
    p.add_argument("--seed", type=int, default=0)
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--recorded", nargs="*", default=sorted(glob.glob(os.path.join(here, "data", "*.npz"))),
                   help="npz files of recorded calibration inputs (default: benchmarks/calibration/data/)")
    p.add_argument("--compact", nargs=2, metavar=("RECORD_DIR", "OUT_NPZ"),
                   help="only compact a record_dir into an npz, then exit")
    a = p.parse_args(argv)
    if a.compact:
        n = compact(*a.compact)
        print(json.dumps({"compacted": n, "out": a.compact[1]}))
        return 0
    report = {
        "what": "upper-bound rules of Calibrated Clipping; widen_only off, min_clipped_tokens "
                f"{a.min_clipped}; fallback -> host bounds; behaviour on a held-out sample "
                f"of {HELD_OUT} tokens (model) or the same tokens (recorded)",
        "gaussian": study_gaussian(a.trials, a.min_clipped, a.quick, a.seed),
        "recorded": study_recorded(a.recorded, a.min_clipped),
    }
    print(json.dumps(_json_safe(report), indent=1, allow_nan=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
