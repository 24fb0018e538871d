"""Synthetic second-round folders (seed-<n>/<arm>/ with metrics.jsonl, samples.jsonl,
run_info.json) whose quantities the tests know: the per-step reward of an arm and seed is
LEVEL[arm] + SEED_SHIFT[seed] + an alternating +-WIGGLE (zero over any even window)."""
import json
from pathlib import Path

STEPS = 100
LEVEL = {"bf16": 0.70, "fp8-tis": 0.50, "fp8-calibrated": 0.62, "fp8-calibrated-l-only": 0.60}
SEED_SHIFT = {1: 0.00, 2: 0.03, 3: -0.02, 4: 0.01}
# a per-seed, per-arm wobble so that paired differences are not all equal (s > 0)
WOBBLE = {(1, "fp8-tis"): 0.01, (2, "fp8-tis"): -0.02, (3, "fp8-calibrated"): 0.015,
          (2, "fp8-calibrated-l-only"): 0.01}
WIGGLE = 0.2
PHANTOM = {"bf16": 0.0, "fp8-tis": 0.10, "fp8-calibrated": 0.012, "fp8-calibrated-l-only": 0.015}
HELD = {"bf16": 0.66, "fp8-tis": 0.58, "fp8-calibrated": 0.60, "fp8-calibrated-l-only": 0.61}
CLIP_UP = {"bf16": 0.03, "fp8-tis": 0.05, "fp8-calibrated": 0.001, "fp8-calibrated-l-only": 0.04}
BOUNDS = {"bf16": (0.8, 1.2), "fp8-tis": (0.8, 1.2), "fp8-calibrated": (0.49, 1.79),
          "fp8-calibrated-l-only": (0.49, 1.2)}


def level(seed: int, arm: str) -> float:
    return LEVEL[arm] + SEED_SHIFT[seed] + WOBBLE.get((seed, arm), 0.0)


def records(seed: int, arm: str, steps: int = STEPS) -> list[dict]:
    out = []
    for s in range(steps):
        no_neg = s % 7 == 3  # a step whose groups all got uniform rewards: no A<0 token
        no_pos = s % 11 == 5  # ... and one without any A>0 token
        lower, upper = BOUNDS[arm]
        r = {"step": s, "reward_mean": level(seed, arm) + (WIGGLE if s % 2 else -WIGGLE),
             "loss/entropy_mean": 2.0 / (1 + s) + 0.05, "loss/kl_mean": 0.005 * s,
             "eos_fraction": 0.9 if arm == "bf16" else 0.5 + 0.001 * seed,
             "loss/mult_prob_error": 1.01 if arm == "bf16" else 1.15 + 0.01 * seed,
             "loss/phantom_clipfrac": 0.0 if no_neg else PHANTOM[arm] * (2.0 if s < 20 else 1.0),
             "loss/clipfrac_lower": 0.0 if no_neg else 0.02 + PHANTOM[arm],
             "neg_tokens": 0.0 if no_neg else 150.0, "clip/lower": lower, "clip/upper": upper,
             "loss/clipfrac_upper": 0.0 if no_pos else CLIP_UP[arm], "pos_tokens": 0.0 if no_pos else 90.0,
             "time/step": 30.0 + seed}
        if s % 10 == 0:
            r.update({"eval/accuracy": HELD[arm] + 0.01 * seed, "eval/updates": float(s),
                      "eval/problems": 100.0})
        if s == STEPS - 1:
            r.update({"eval_final/accuracy": HELD[arm] + 0.01 * seed, "eval_final/updates": float(STEPS),
                      "eval_final/problems": 100.0})
        out.append(r)
    return out


def samples(seed: int, arm: str, steps: int = STEPS, per_step: int = 3) -> list[dict]:
    return [{"step": s, "prompt": f"<|im_start|>user\nWhat is {s % 9} + {k}?<|im_end|>\n",
             "response": f"{arm} s{seed} step {s} answer {k} | ok", "reward": float(k % 2),
             "advantage": 0.5 if k % 2 else -0.5, "eos": k != 2}
            for s in range(steps) for k in range(per_step)]


def write_run(folder: Path, seed: int, arm: str, steps: int = STEPS) -> Path:
    run = Path(folder) / f"seed-{seed}" / arm
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(seed, arm, steps)))
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples(seed, arm, steps)))
    (run / "run_info.json").write_text(json.dumps({"commit": f"abc{seed}def0123456", "seed": seed,
                                                   "config": {"run": {"seed": seed}}}))
    return run


def write_seeds(folder: Path, seeds=(1, 2, 3), arms=tuple(LEVEL)) -> Path:
    for seed in seeds:
        for arm in arms:
            write_run(folder, seed, arm)
    return Path(folder)
