"""Helpers every section shares: small numeric summaries, a model on the check's device,
per-token log-probs, and freeing accelerator memory between sections."""
from __future__ import annotations

import gc
import math
import time
from typing import Optional

import torch

from megatron_calibclip.bench.gpu_check.options import ModelShape
from megatron_calibclip.parallel.devices import HOST


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


def build_emulated_gpt(shape: ModelShape, device: str, seed: Optional[int] = 0):
    """(model, cfg): the trainer's policy architecture (local spec with the emulated linears,
    fp32 master weights, precision a switch on the model) on `device`. seed None: megatron's
    own initialisation (fast on a GPU for billion-parameter shapes)."""
    from megatron_calibclip.models import build_policy_model, emulated_layer_spec, get_preset

    cfg = get_preset("tiny", **shape.overrides())
    model = build_policy_model(cfg, spec=emulated_layer_spec(cfg), seed=seed)
    return model.to(device), cfg


def random_tokens(batch: int, seq: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=HOST).manual_seed(seed)  # the same tokens on any device
    return torch.randint(1, vocab, (batch, seq), generator=gen, device=HOST).to(device)


def token_logprobs(model, cfg, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]), [b, s-1] fp32, through the package's forward."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    return shifted_logprobs_entropy(forward_logits(model, tokens), tokens, cfg.vocab_size)[0]


def error_record(err: BaseException) -> dict[str, str]:
    """What the JSON keeps of an exception: its type and its first 2,000 characters."""
    return {"type": type(err).__name__, "message": str(err)[:2000]}
