"""Which engine runs the FP8 GEMMs: `fp8.backend: auto | te | torch | emulated`.

- `emulated`: fp32 GEMMs on dequantized operands (fp8/linear.py); runs anywhere, the CPU
  reference for every numeric path.
- `torch`: real FP8 GEMMs through `torch._scaled_mm`, fed by the same quantizer
  (fp8/quantize.py) the emulation uses, so codes and scales are identical by construction.
  Tensorwise, delayed and rowwise scaling (what `_scaled_mm` takes on every device, CPU
  included); blockwise and mxfp8 need torch's block-scaled kernels and are refused here.
- `te`: Transformer Engine's layers (fp8/te.py maps the recipe); needs CUDA and TE.
- `auto`: te with CUDA and TE installed, else torch with CUDA, else emulated.

`resolve_backend` says which one a run gets and why (`calibclip info` prints it).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from megatron_calibclip.config import ConfigError
from megatron_calibclip.fp8.recipe import BACKEND_VALUES

TORCH_GRANULARITIES: tuple[str, ...] = ("tensorwise", "delayed", "rowwise")


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[bool, bool, bool]:
    """(CUDA, transformer-engine installed, torch._scaled_mm): fixed for a process, looked up
    once (every emulated FP8 forward resolves its backend)."""
    return (torch.cuda.is_available(), importlib.util.find_spec("transformer_engine") is not None,
            hasattr(torch, "_scaled_mm"))


@functools.lru_cache(maxsize=None)
def _resolve(requested: str, cuda: bool, te: bool, scaled_mm: bool) -> tuple[str, str]:
    if requested not in BACKEND_VALUES:
        raise ConfigError(f"fp8.backend: {requested!r} is not one of {list(BACKEND_VALUES)}")
    if requested == "emulated":
        return "emulated", "requested"
    if requested == "te":
        if not (cuda and te):
            missing = ", ".join(x for x, ok in (("a CUDA device", cuda), ("transformer-engine", te))
                                if not ok)
            raise ConfigError(f"fp8.backend: 'te' needs a CUDA device and transformer-engine "
                              f"(missing here: {missing}); use 'torch' or 'emulated'")
        return "te", "requested"
    if requested == "torch":
        if not scaled_mm:
            raise ConfigError("fp8.backend: 'torch' needs torch._scaled_mm, which this torch "
                              f"({torch.__version__}) lacks")
        return "torch", "requested"
    if cuda and te:
        return "te", "auto: CUDA and transformer-engine are available"
    if cuda and scaled_mm:
        return "torch", "auto: CUDA without transformer-engine, so torch._scaled_mm"
    return "emulated", "auto: no CUDA device, so the CPU emulation"


def resolve_backend(requested: str) -> tuple[str, str]:
    """(backend, why) for `fp8.backend = requested` on this machine; ConfigError if the
    requested backend cannot run here."""
    return _resolve(requested, *_machine())


def check_backend_supports(backend: str, granularity: str) -> None:
    """ConfigError when `backend` cannot run this scaling granularity."""
    if backend == "torch" and granularity not in TORCH_GRANULARITIES:
        raise ConfigError(
            f"fp8.backend 'torch' runs {', '.join(TORCH_GRANULARITIES)} scaling; "
            f"{granularity!r} needs torch's block-scaled GEMMs, not wired yet "
            f"(use fp8.backend 'te' on GPU, or 'emulated')")
