"""(d) GRPO steps of a ~100M-parameter random model on one device, in BF16 and in FP8 with
Calibrated Clipping, through the package's trainer (`trainer.train`), as a user would run it.

Why through the trainer and not a re-implementation: this is the check that the product
itself runs on the device. Prompts are one-digit sums written to a JSONL in a temporary
folder (no task package needed), the tokenizer is trained on them, rewards are exact-answer
math rewards. A random model earns almost no reward: the thresholds are about the run
completing with finite numbers and calibrating when it should, not about learning.

The trainer decides its own path (`fp8.backend: auto`): on a GPU with transformer-engine
it builds megatron's TE spec and refuses `rollout.engine: megatron` (trainer/te_run.py
check_te_run), so this section then rolls out with vLLM, as the H100 recipes do; without
vLLM installed the section fails with that one line. On the CPU (and on a GPU without TE)
it runs our emulated-linear spec with the megatron rollout engine.
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
             "loss/mult_prob_error", "time/step")
THRESHOLDS = {
    "steps_completed": "all requested steps, in both runs",
    "finite": ["loss/total", "grad_norm", "loss/entropy_mean", "reward_mean"],
    "fp8_calibrations": "a calibration record on every step with step % period == 0",
    # rollout vs trainer log-probs of the same tokens, every trained step: mean over response
    # tokens of exp|log p_rollout - log p_old| (rl/correction_term.py). Why these bounds: on
    # the CPU (same engine family) BF16 runs stay at 1.00-1.03 and emulated-FP8 runs at
    # 1.00-1.51 (round 2 of the reproduction, 300 steps each); a layout bug such as left
    # padding read as lengths (0.17 nats off on whole rows) puts BF16 far above 1.05
    "mult_prob_error_max": {"bf16": 1.05, "fp8": 1.6},
}


def write_prompts(path: Path, count: int = 96, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(count):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            fh.write(json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n")
    return path


FP8_SECTION = {"format": "hybrid", "granularity": "tensorwise", "backend": "auto"}
REFERENCE = ("the trainer's own thresholds: every step completes with finite loss, grad "
             "norm, entropy and reward; the rollout engine's log-probs agree with the "
             "trainer's (loss/mult_prob_error); Calibrated Clipping calibrates on every due "
             "step")


def trainer_path(opts: CheckOptions) -> tuple[str, str]:
    """(trainer backend, rollout engine) for this run: te_run.trainer_backend on the FP8
    section the configs use; TE runs roll out with vLLM."""
    from megatron_calibclip.fp8 import FP8Recipe
    from megatron_calibclip.trainer.te_run import trainer_backend

    if opts.device != "cuda":  # --device cpu on a CUDA machine: the CPU's path
        return "ours", "megatron"
    backend = trainer_backend(FP8Recipe.from_dict(FP8_SECTION))
    return backend, "vllm" if backend == "te" else "megatron"


def train_config(opts: CheckOptions, precision: str, folder: Path, prompts: Path,
                 engine: str = "megatron"):
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
        "rollout": {"precision": precision, "engine": engine,
                    "sampling": {"max_new_tokens": opts.grpo_new_tokens}},
        "algorithm": {"group_size": opts.grpo_group_size,
                      "prompts_per_step": opts.grpo_prompts_per_step, "mini_batches": 2,
                      "micro_batch_size": 8, "logprob_micro_batch_size": 16},
        "clipping": {"mode": "calibrated" if fp8 else "fixed",
                     "calibration": {"period": opts.grpo_calibration_period}},
        "optimizer": {"lr": 1e-5},
        "precision": precision,
        # auto: TE's spec on a GPU with transformer-engine, else torch._scaled_mm on a GPU,
        # the emulation on the CPU (--smoke)
        "fp8": dict(FP8_SECTION),
    })


def _finite(record: dict, key: str) -> bool:
    value = record.get(key)
    return isinstance(value, (int, float)) and math.isfinite(value)


def run_one(opts: CheckOptions, precision: str, folder: Path, prompts: Path,
            engine: str) -> dict:
    from megatron_calibclip.trainer import train

    t0 = time.perf_counter()
    records = train(train_config(opts, precision, folder, prompts, engine))["records"]
    out: dict = {"ran": True, "wall_s": round(time.perf_counter() - t0, 2),
                 "steps": [{"step": r["step"], **{k: r[k] for k in STEP_KEYS if k in r}}
                           for r in records]}
    trained = [r for r in records if "skipped" not in r]
    bad = [(r["step"], k) for r in trained for k in THRESHOLDS["finite"] if not _finite(r, k)]
    out["steps_completed"] = len(records)
    out["non_finite"] = bad
    bound = THRESHOLDS["mult_prob_error_max"][precision]
    mismatch = [r.get("loss/mult_prob_error") for r in trained]
    out["mult_prob_error_max"] = max((m for m in mismatch if m is not None), default=None)
    mismatch_ok = all(isinstance(m, (int, float)) and math.isfinite(m) and m <= bound
                      for m in mismatch)
    ok = len(records) == opts.grpo_steps and bool(trained) and not bad and mismatch_ok
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
    from megatron_calibclip.bench.gpu_check.common import case_error, cases_passed, not_run
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.rollout.vllm_settings import vllm_installed

    shape = get_preset("tiny", **opts.grpo_model.overrides())
    backend, engine = trainer_path(opts)
    head = {"reference": REFERENCE, "thresholds": THRESHOLDS, "model": vars(opts.grpo_model),
            "parameters_at_vocab_4096": shape.num_parameters(),
            "requested_steps": opts.grpo_steps, "trainer_backend": backend,
            "rollout_engine": engine}
    if engine == "vllm" and not vllm_installed():
        return {**head, **not_run("the trainer builds TE's spec here, which rolls out with "
                                  "vLLM (te_run.check_te_run), and vllm is not installed "
                                  "(pip install '.[vllm]')"), "passed": False}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_grpo_") as tmp:
        prompts = write_prompts(Path(tmp) / "prompts.jsonl")
        for precision in ("bf16", "fp8"):
            try:
                runs[precision] = run_one(opts, precision, Path(tmp), prompts, engine)
            except Exception as err:  # noqa: BLE001 - the other run still goes
                runs[precision] = case_error(err)
    return {**head, "ran": True, "runs": runs, "passed": cases_passed(runs)}
