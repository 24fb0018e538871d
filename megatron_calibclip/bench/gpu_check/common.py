"""Helpers every section shares: how a check records what it could not run, the models as
the trainer builds them, per-token log-probs, small numeric summaries, freeing memory.

Why one place for "not run": a check that cannot run must never read as a pass. Every case
(and every section) carries `ran`; one that did not run says `why` and, when the reason is
a limitation of this machine, names it (`limitation`). runner.verdict decides what a
limitation may excuse (only a CPU limitation in a `--smoke` run on the CPU; on a GPU only
a feature this GPU's compute capability lacks).
"""
from __future__ import annotations

import gc
import importlib
import importlib.util
import math
import time
from typing import Any, Optional

import torch

from megatron_calibclip.bench.gpu_check.options import ModelShape
from megatron_calibclip.parallel.devices import HOST

# Limitations of a CPU machine that a `--smoke` run on the CPU may leave unrun (the same
# check then runs on the GPU). Anything else not run is a failure.
NO_CUDA = "no_cuda"
NO_TE = "no_transformer_engine"
CPU_NO_BLOCK_SCALED_MM = "cpu_no_block_scaled_mm"
CPU_LIMITATIONS = {
    NO_CUDA: "no CUDA device",
    NO_TE: "transformer-engine is not installed",
    CPU_NO_BLOCK_SCALED_MM: "CPU torch has no block-scaled F.scaled_mm kernel",
}
# A recipe the GPU's compute capability cannot run at all (mxfp8 before Blackwell, Hopper's
# blockwise elsewhere): recorded with the capability, not a failure on that GPU.
NOT_SUPPORTED_BY_THIS_GPU = "not_supported_by_this_gpu"


def not_run(why: str, limitation: Optional[str] = None, **extra: Any) -> dict[str, Any]:
    """The record of a case (or section) that did not run: `why`, and the machine limitation
    behind it if there is one (None: a refusal, a missing backend, a bug: always a failure)."""
    return {"ran": False, "why": why, "limitation": limitation, **extra}


def case_error(err: BaseException) -> dict[str, Any]:
    """A case that raised: not run, failed, with the exception's type and message."""
    return {**not_run(f"raised {type(err).__name__}: {str(err)[:300]}"),
            "error": error_record(err), "passed": False}


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_unavailable(device: str) -> Optional[dict[str, Any]]:
    """A not-run record when Transformer Engine cannot run here (not installed, or no CUDA
    device for it), else None."""
    if not te_installed():
        return not_run("transformer-engine not installed", NO_TE)
    if device != "cuda":
        return not_run("transformer-engine needs a CUDA device", NO_CUDA)
    return None


def _te_own_support(granularity: str) -> tuple[bool, str]:
    """Transformer Engine's own capability check for a recipe (transformer_engine.pytorch
    .fp8 in TE 1.x/2.x, .quantization in newer releases: check_fp8_support,
    check_fp8_block_scaling_support, check_mxfp8_support, each () -> (bool, str))."""
    names = {"mxfp8": "check_mxfp8_support", "blockwise": "check_fp8_block_scaling_support"}
    name = names.get(granularity, "check_fp8_support")
    for module in ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization"):
        try:
            ok, reason = getattr(importlib.import_module(module), name)()
            return bool(ok), str(reason)
        except (ImportError, AttributeError):
            continue
    return False, f"transformer-engine has no {name} in .pytorch.fp8 or .pytorch.quantization"


def te_recipe_problem(granularity: str, device: str) -> Optional[dict[str, Any]]:
    """A not-run record when Transformer Engine cannot run this FP8 recipe on this GPU, else
    None. What the GPU's compute capability itself lacks (fp8/te.py te_device_problem without
    the CUDA version: mxfp8 below 10.0, blockwise off Hopper) is NOT_SUPPORTED_BY_THIS_GPU;
    anything else (torch's CUDA too old, TE's own check refusing, the environment TE was
    imported with) is a plain not-run, i.e. a failure."""
    from megatron_calibclip.fp8 import FP8Recipe
    from megatron_calibclip.fp8.te import te_device_problem, te_environment_problem

    capability = gpu_capability(device)
    recipe = FP8Recipe(granularity=granularity)
    hardware = te_device_problem(recipe, capability, None)
    if hardware is not None:
        return not_run(hardware, NOT_SUPPORTED_BY_THIS_GPU, capability=list(capability))
    software = te_device_problem(recipe, capability, torch.version.cuda)
    if software is not None:
        return not_run(software)
    ok, reason = _te_own_support(granularity)
    if not ok:
        return not_run(f"transformer-engine refuses {granularity} here: {reason}")
    environment = te_environment_problem(recipe)
    return None if environment is None else not_run(environment)


def gpu_capability(device: str) -> Optional[tuple[int, int]]:
    return tuple(torch.cuda.get_device_capability()) if device == "cuda" else None


def trainer_params_dtype(device: str) -> torch.dtype:
    """What the trainer holds parameters in on `device` with the default `model.params_dtype:
    auto` (the trainer's own rule: ModelSection.resolved_params_dtype)."""
    from megatron_calibclip.trainer.config import ModelSection

    resolved = ModelSection().resolved_params_dtype(cuda=device == "cuda")
    return torch.bfloat16 if resolved == "bf16" else torch.float32


def trainer_backend_for(device: str, recipe) -> str:
    """'te' when the trainer, given this FP8 recipe on `device`, builds megatron's TE spec,
    else 'ours' (our linears): trainer/te_run.trainer_backend, with `device` in place of the
    machine it runs on (--device cpu on a CUDA machine takes the CPU's path)."""
    from megatron_calibclip.trainer.te_run import trainer_backend

    cuda = device == "cuda"
    return trainer_backend(recipe, machine=(cuda, cuda and te_installed(), hasattr(torch, "_scaled_mm")))


def build_gpt(shape: ModelShape, device: str, spec: str, seed: Optional[int] = 0,
              params_dtype: Optional[torch.dtype] = None):
    """(model, cfg) built as trainer/components.py builds its policy: build_policy_model with
    the layer spec (`spec`: "te" = models.te_layer_spec, "emulated" = emulated_layer_spec),
    the trainer's params dtype for `device` unless given, then place_on_device (never
    `model.to`: RoPE's inv_freq is not moved by it). seed None: megatron's own init (fast
    on a GPU for billion-parameter shapes)."""
    from megatron_calibclip.models import (
        build_policy_model,
        emulated_layer_spec,
        get_preset,
        place_on_device,
        te_layer_spec,
    )

    cfg = get_preset("tiny", **shape.overrides())
    layer_spec = {"te": te_layer_spec, "emulated": emulated_layer_spec}[spec](cfg)
    dtype = params_dtype if params_dtype is not None else trainer_params_dtype(device)
    model = build_policy_model(cfg, spec=layer_spec, seed=seed, params_dtype=dtype,
                               calculate_per_token_loss=True)
    place_on_device(model, torch.device(device))
    return model, cfg


def rel_fro(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want||_F / ||want||_F in float64 (one number per GEMM, insensitive to size)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp(min=1e-300)).item()


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.double() - b.double()).abs()
    return {"max": d.max().item(), "mean": d.mean().item()}


def all_finite(*values) -> bool:
    """True when every number (or nested dict/list of numbers) is finite."""
    def ok(v) -> bool:
        if isinstance(v, dict):
            return all(ok(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return all(ok(x) for x in v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return math.isfinite(v)
        return True
    return all(ok(v) for v in values)


def cases_passed(cases: dict[str, dict]) -> bool:
    """A section's own verdict over its cases that ran (those that did not are judged by
    runner.verdict, which knows the machine and the mode)."""
    return all(c.get("passed") is True for c in cases.values() if c.get("ran", True))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def now(device: str) -> float:
    """perf_counter after the device finished its queued work (honest GPU timings)."""
    synchronize(device)
    return time.perf_counter()


def free_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def random_tokens(batch: int, seq: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=HOST).manual_seed(seed)  # the same tokens on any device
    return torch.randint(1, vocab, (batch, seq), generator=gen, device=HOST).to(device)


def no_padding_mask(tokens: torch.Tensor) -> torch.Tensor:
    """The key-padding mask of unpadded rows, [b, 1, 1, s], True = masked: the trainer's
    batches always carry one (rollout/batch.py), and TE's padding_causal attention reads it."""
    b, s = tokens.shape
    return torch.zeros(b, 1, 1, s, dtype=torch.bool, device=tokens.device)


def token_logprobs(model, cfg, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]), [b, s-1] fp32, one forward of the model
    (with autograd when enabled)."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    logits = forward_logits(model, tokens, no_padding_mask(tokens))
    return shifted_logprobs_entropy(logits, tokens, cfg.vocab_size)[0]


def trainer_logprobs(model, cfg, tokens: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """Per-token log-probs [b, s-1] through the trainer's own path (trainer/forward.py
    compute_logprobs: megatron's schedule, micro-batches, TE's token-multiple padding)."""
    from megatron_calibclip.trainer.forward import compute_logprobs

    lp, _ = compute_logprobs(model, tokens, no_padding_mask(tokens), vocab_size=cfg.vocab_size,
                             temperature=1.0, micro_batch_size=micro_batch_size, pad_id=0)
    return lp


def error_record(err: BaseException) -> dict[str, str]:
    """What the JSON keeps of an exception: its type and its first 2,000 characters."""
    return {"type": type(err).__name__, "message": str(err)[:2000]}
