"""The prepared GPU check (`tools/gpu_check.py`): what a lent GPU must confirm, in one run.

Why one script: a lent GPU machine gives a session minutes, not hours; everything it should
measure is prepared here, rehearsed on the CPU (`--smoke`: the same code paths on tiny
shapes), and run once. Each section is independent: one that fails records its error and
the others still run. A section passes when its stated thresholds hold; sections that only
measure (batch invariance, throughput) pass when their figures are finite.

  a quantizer   our quantizer's FP8 codes and scales on the device vs on the CPU (bit
                equality), and torch._scaled_mm vs the dequantized fp32 GEMM
  b logprobs    emulated vs native (torch backend) FP8 log-probs of one GPT, against the
                size of the FP8 effect itself (FP8 vs BF16)
  c batch       log-probs of 4 sequences in one micro-batch vs two of 2 (bf16, tensorwise,
                blockwise)
  d grpo        GRPO steps of a random model through the trainer, BF16 and FP8 calibrated
  e throughput  GEMM-level forward throughput FP8 (_scaled_mm) vs BF16 on 1-3B shapes
"""
from __future__ import annotations

import json
import math
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch


@dataclass(frozen=True)
class CheckPlan:
    """Sizes of every section; `smoke()` is the CPU rehearsal."""

    ks: tuple[int, ...] = (4096, 12288)
    gemm_rows: int = 512
    model_preset: str = "smollm2-135m"  # random weights, small vocabulary (tokenizer train:N)
    seq_len: int = 128
    grpo_steps: int = 20
    grpo_overrides: tuple[str, ...] = ("model.preset=smollm2-135m", "data.tokenizer=train:512",
                                       "algorithm.prompts_per_step=8", "warmup.steps=20")
    throughput_shapes: tuple[tuple[int, int], ...] = ((2048, 8192), (2048, 2048))  # (K, N)
    throughput_tokens: int = 8192
    throughput_repeats: int = 20

    @staticmethod
    def smoke() -> "CheckPlan":
        return CheckPlan(ks=(256, 512), gemm_rows=64, model_preset="tiny", seq_len=24,
                         grpo_steps=2, grpo_overrides=("algorithm.prompts_per_step=4",
                                                       "algorithm.group_size=4",
                                                       "warmup.steps=2",
                                                       "rollout.sampling.max_new_tokens=3"),
                         throughput_shapes=((128, 256),), throughput_tokens=128,
                         throughput_repeats=2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def check_quantizer(plan: CheckPlan, device: torch.device) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe
    from megatron_calibclip.fp8.quantize import quantize
    from megatron_calibclip.fp8.scaled_mm import scaled_mm

    out: dict = {"thresholds": {"codes_equal": True, "scales_equal": True, "gemm_rel_max": 1e-4}}
    ok = True
    for k in plan.ks:
        g = torch.Generator().manual_seed(k)
        x = torch.randn(plan.gemm_rows, k, generator=g)
        w = torch.randn(plan.gemm_rows * 2, k, generator=g) * 0.02
        for gran in ("tensorwise", "rowwise"):
            r = FP8Recipe(granularity=gran)
            q_cpu = quantize(x, r, "activation")
            qx, qw = quantize(x.to(device), r, "activation"), quantize(w.to(device), r, "weight")
            codes = torch.equal(q_cpu.data.view(torch.uint8), qx.data.cpu().view(torch.uint8))
            scales = torch.equal(q_cpu.scale_inv, qx.scale_inv.cpu())
            ref = qx.dequantize() @ qw.dequantize().t()
            rel = _rel(scaled_mm(qx, qw, x.shape[0], w.shape[0], gran), ref)
            out[f"k{k}_{gran}"] = {"codes_equal": codes, "scales_equal": scales, "gemm_rel": rel}
            ok &= codes and scales and rel <= 1e-4
    out["passed"] = ok
    return out


def _model(plan: CheckPlan, device: torch.device):
    from megatron_calibclip.fp8 import fp8_linear_classes
    from megatron_calibclip.models import build_policy_model, get_preset, local_layer_spec

    cfg = get_preset(plan.model_preset, **({"vocab_size": 512} if plan.model_preset != "tiny"
                                            else {}))
    model = build_policy_model(cfg, spec=local_layer_spec(cfg, **fp8_linear_classes()), seed=0)
    return model.to(device).eval(), cfg


def _logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    with torch.no_grad():
        logits = model(tokens, pos, None).float()  # [b, s, v]
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def check_logprobs(plan: CheckPlan, device: torch.device) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe, set_precision

    model, cfg = _model(plan, device)
    tokens = torch.randint(1, cfg.vocab_size, (4, plan.seq_len),
                           generator=torch.Generator().manual_seed(1)).to(device)
    set_precision(model, "bf16")
    bf16 = _logprobs(model, tokens)
    out: dict = {"thresholds": {"native_vs_emulated_over_fp8_effect_max": 0.1}}
    ok = True
    for gran in ("tensorwise", "rowwise"):
        lps = {}
        for backend in ("emulated", "torch"):
            set_precision(model, "fp8", FP8Recipe(granularity=gran, backend=backend))
            lps[backend] = _logprobs(model, tokens)
        gap = float((lps["torch"] - lps["emulated"]).abs().mean())
        effect = float((lps["emulated"] - bf16).abs().mean())
        ratio = gap / effect if effect > 0 else math.inf
        out[gran] = {"mean_abs_native_vs_emulated": gap, "mean_abs_fp8_vs_bf16": effect,
                     "ratio": ratio,
                     "max_abs_native_vs_emulated": float((lps["torch"] - lps["emulated"]).abs().max())}
        ok &= ratio <= 0.1
    out["passed"] = ok
    return out


def check_batch_invariance(plan: CheckPlan, device: torch.device) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe, set_precision

    model, cfg = _model(plan, device)
    tokens = torch.randint(1, cfg.vocab_size, (4, plan.seq_len),
                           generator=torch.Generator().manual_seed(2)).to(device)
    out: dict = {"thresholds": {"figures_finite": True}}
    for name, mode, recipe in (("bf16", "bf16", None),
                               ("tensorwise", "fp8", FP8Recipe(granularity="tensorwise")),
                               ("blockwise", "fp8", FP8Recipe(granularity="blockwise",
                                                              backend="emulated"))):
        set_precision(model, mode, recipe)
        whole = _logprobs(model, tokens)
        halves = torch.cat([_logprobs(model, tokens[:2]), _logprobs(model, tokens[2:])])
        out[name] = {"max_abs_mb4_vs_mb2": float((whole - halves).abs().max()),
                     "bitwise_equal": bool(torch.equal(whole, halves))}
    out["passed"] = all(math.isfinite(v["max_abs_mb4_vs_mb2"]) for k, v in out.items()
                        if isinstance(v, dict) and "max_abs_mb4_vs_mb2" in v)
    return out


def check_grpo(plan: CheckPlan, device: torch.device) -> dict:
    from megatron_calibclip.trainer import train
    from megatron_calibclip.trainer.config import load_train_config

    out: dict = {"thresholds": {"finite_loss_every_step": True}}
    ok = True
    arms = {"bf16": ["precision=bf16", "rollout.precision=bf16", "clipping.mode=fixed"],
            "fp8-calibrated": ["precision=fp8", "rollout.precision=fp8",
                               "clipping.mode=calibrated", "clipping.calibration.period=1",
                               "clipping.calibration.min_clipped_tokens=1"]}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, sets in arms.items():
            cfg = load_train_config("tiny-cpu", [
                *plan.grpo_overrides, *sets, f"run.steps={plan.grpo_steps}", f"run.name={arm}",
                f"run.output_dir={tmp}", "run.progress=false", "run.tensorboard=false",
                "run.plot=false", "run.checkpoint=false", "parallel.tp=1", "parallel.pp=1"])
            t = time.perf_counter()
            records = train(cfg, init_distributed=False)["records"]
            losses = [r.get("loss/total", math.nan) for r in records]
            out[arm] = {"steps": len(records), "seconds": round(time.perf_counter() - t, 2),
                        "reward": [round(r.get("reward_mean", math.nan), 4) for r in records],
                        "entropy": [round(r.get("loss/entropy_mean", math.nan), 4)
                                    for r in records],
                        "calibrations_ok": sum(1 for r in records if r.get("calib/fallback") == 0.0)}
            ok &= len(records) == plan.grpo_steps and all(math.isfinite(v) for v in losses)
    out["passed"] = ok
    return out


def _time(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def check_throughput(plan: CheckPlan, device: torch.device) -> dict:
    from megatron_calibclip.fp8 import FP8Recipe
    from megatron_calibclip.fp8.quantize import quantize
    from megatron_calibclip.fp8.scaled_mm import scaled_mm

    out: dict = {"thresholds": {"figures_finite": True},
                 "note": "GEMM-level forward throughput, not a training step: the trainer "
                         "does not yet run BF16 mixed precision on GPUs (issue 11, item 2)"}
    m, recipe = plan.throughput_tokens, FP8Recipe(granularity="tensorwise")
    for k, n in plan.throughput_shapes:
        x = torch.randn(m, k, device=device)
        w = torch.randn(n, k, device=device) * 0.02
        xb, wb = x.bfloat16(), w.bfloat16()
        qw = quantize(w, recipe, "weight")
        bf16_s = _time(lambda: xb @ wb.t(), plan.throughput_repeats, device)
        fp8_s = _time(lambda: scaled_mm(quantize(x, recipe, "activation"), qw, m, n,
                                        "tensorwise"), plan.throughput_repeats, device)
        tflop = 2 * m * k * n / 1e12
        out[f"{m}x{k}x{n}"] = {"bf16_tflops": tflop / bf16_s, "fp8_tflops": tflop / fp8_s,
                               "fp8_over_bf16": bf16_s / fp8_s}
    out["passed"] = all(math.isfinite(v["fp8_over_bf16"]) for v in out.values()
                        if isinstance(v, dict) and "fp8_over_bf16" in v)
    return out


SECTIONS: dict[str, Callable[[CheckPlan, torch.device], dict]] = {
    "a_quantizer": check_quantizer, "b_logprobs": check_logprobs,
    "c_batch_invariance": check_batch_invariance, "d_grpo": check_grpo,
    "e_throughput": check_throughput,
}


@dataclass
class CheckResult:
    sections: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(s.get("passed") is True for s in self.sections.values())


def run_check(plan: CheckPlan, device: torch.device, out_dir: Path, log=print) -> CheckResult:
    """Every section in turn (a failure is recorded, never fatal); writes gpu_check.json."""
    from megatron_calibclip.fp8.backend import resolve_backend
    from megatron_calibclip.parallel import ParallelLayout, initialize_distributed, teardown

    result = CheckResult()
    env = {"torch": torch.__version__, "device": str(device),
           "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "capability": (list(torch.cuda.get_device_capability(device))
                          if device.type == "cuda" else None),
           "auto_backend": list(resolve_backend("auto"))}
    initialize_distributed(ParallelLayout(1, 1), seed=0)
    t0 = time.perf_counter()
    try:
        for name, fn in SECTIONS.items():
            t = time.perf_counter()
            try:
                section = fn(plan, device)
            except Exception as err:  # recorded: the other sections still run
                section = {"passed": False, "error": f"{type(err).__name__}: {err}",
                           "traceback": traceback.format_exc(limit=6)}
            section["seconds"] = round(time.perf_counter() - t, 2)
            result.sections[name] = section
            log(f"{name}: {'passed' if section.get('passed') else 'FAILED'} "
                f"({section['seconds']}s){' ' + section['error'] if 'error' in section else ''}")
    finally:
        teardown()
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"env": env, "plan": plan.__dict__, "passed": result.passed,
           "wall_seconds": round(time.perf_counter() - t0, 1), "sections": result.sections}
    (out_dir / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))
    return result
