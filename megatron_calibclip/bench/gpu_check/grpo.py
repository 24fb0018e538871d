"""(d) GRPO steps of a ~100M-parameter random model on one device, in BF16 and in FP8 with
Calibrated Clipping, through the package's trainer (`trainer.train`), as a user would run it.

Why through the trainer and not a re-implementation: this is the check that the product
itself runs on the device. Prompts are one-digit sums written to a JSONL in a temporary
folder (no task package needed), the tokenizer is trained on them, rewards are exact-answer
math rewards. A random model earns almost no reward: the thresholds are about the run
completing with finite numbers and calibrating when it should, not about learning.
"""
from __future__ import annotations

import json
import math
import random
import tempfile
import time
from pathlib import Path

from megatron_calibclip.bench.gpu_check.options import CheckOptions

STEP_KEYS = ("reward_mean", "accuracy", "loss/entropy_mean", "loss/total", "grad_norm",
             "clip/lower", "clip/upper", "clip/next_lower", "clip/next_upper", "calib/ran",
             "calib/fallback", "calib/fallback_reason", "calib/alpha", "loss/phantom_clipfrac",
             "time/step")
THRESHOLDS = {
    "steps_completed": "all requested steps, in both runs",
    "finite": ["loss/total", "grad_norm", "loss/entropy_mean", "reward_mean"],
    "fp8_calibrations": "a calibration record on every step with step % period == 0",
}


def write_prompts(path: Path, count: int = 96, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(count):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            fh.write(json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n")
    return path


def train_config(opts: CheckOptions, precision: str, folder: Path, prompts: Path):
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig

    fp8 = precision == "fp8"
    overrides = {k: v for k, v in opts.grpo_model.overrides().items() if k != "vocab_size"}
    return from_dict(TrainConfig, {
        "run": {"name": f"grpo-{precision}", "output_dir": str(folder), "seed": 1,
                "steps": opts.grpo_steps, "progress": False, "tensorboard": False,
                "plot": False, "checkpoint": False},
        "model": {"preset": "tiny", "overrides": overrides},
        "data": {"source": "jsonl", "path": str(prompts), "tokenizer": "train:64",
                 "template": "{prompt}", "max_prompt_tokens": 32},
        "reward": {"kind": "math"},
        "rollout": {"precision": precision, "sampling": {"max_new_tokens": opts.grpo_new_tokens}},
        "algorithm": {"group_size": opts.grpo_group_size,
                      "prompts_per_step": opts.grpo_prompts_per_step, "mini_batches": 2,
                      "micro_batch_size": 8, "logprob_micro_batch_size": 16},
        "clipping": {"mode": "calibrated" if fp8 else "fixed",
                     "calibration": {"period": opts.grpo_calibration_period}},
        "optimizer": {"lr": 1e-5},
        "precision": precision,
        # auto: torch._scaled_mm on a GPU, the emulation on the CPU (--smoke)
        "fp8": {"format": "hybrid", "granularity": "tensorwise", "backend": "auto"},
    })


def _finite(record: dict, key: str) -> bool:
    value = record.get(key)
    return isinstance(value, (int, float)) and math.isfinite(value)


def run_one(opts: CheckOptions, precision: str, folder: Path, prompts: Path) -> dict:
    from megatron_calibclip.trainer import train

    t0 = time.perf_counter()
    records = train(train_config(opts, precision, folder, prompts))["records"]
    out: dict = {"wall_s": round(time.perf_counter() - t0, 2),
                 "steps": [{"step": r["step"], **{k: r[k] for k in STEP_KEYS if k in r}}
                           for r in records]}
    trained = [r for r in records if "skipped" not in r]
    bad = [(r["step"], k) for r in trained for k in THRESHOLDS["finite"] if not _finite(r, k)]
    out["steps_completed"] = len(records)
    out["non_finite"] = bad
    ok = len(records) == opts.grpo_steps and bool(trained) and not bad
    if precision == "fp8":
        period = opts.grpo_calibration_period
        due = [r["step"] for r in records if r["step"] % period == 0]
        ran = [r["step"] for r in records if r.get("calib/ran")]
        succeeded = [r["step"] for r in records if r.get("calib/fallback") == 0.0]
        out["calibrations"] = {"due": due, "ran": ran, "succeeded": succeeded}
        ok = ok and ran == due
    out["passed"] = ok
    return out


def run(opts: CheckOptions) -> dict:
    from megatron_calibclip.bench.gpu_check.common import error_record
    from megatron_calibclip.models import get_preset

    shape = get_preset("tiny", **opts.grpo_model.overrides())
    runs = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_grpo_") as tmp:
        prompts = write_prompts(Path(tmp) / "prompts.jsonl")
        for precision in ("bf16", "fp8"):
            try:
                runs[precision] = run_one(opts, precision, Path(tmp), prompts)
            except Exception as err:  # noqa: BLE001 - the other run still goes
                runs[precision] = {"error": error_record(err), "passed": False}
    return {"thresholds": THRESHOLDS, "model": vars(opts.grpo_model),
            "parameters_at_vocab_4096": shape.num_parameters(), "requested_steps": opts.grpo_steps,
            "runs": runs, "passed": all(r["passed"] for r in runs.values())}
