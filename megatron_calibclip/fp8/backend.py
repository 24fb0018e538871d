"""Which engine runs the FP8 GEMMs: `fp8.backend: auto | te | torch | emulated`.

- `emulated`: fp32 GEMMs on dequantized operands (fp8/linear.py); runs anywhere, the CPU
  reference for every numeric path.
- `torch`: real FP8 GEMMs through `torch._scaled_mm`, forward and backward (dgrad, and the
  wgrad when fp8_wgrad is on), fed by the same quantizer (fp8/quantize.py) the emulation
  uses, so codes and scales are identical by construction. Tensorwise, delayed and rowwise
  scaling (what `_scaled_mm` takes on every device, CPU included; the dtype pairs and
  layouts each device accepts are in fp8/scaled_mm.py); blockwise and mxfp8 need torch's
  block-scaled kernels and are refused here.
- `te`: megatron-core's Transformer Engine layer spec, built by the trainer for policy and
  reference (trainer/te_run.py); fp8/te.py maps the recipe onto TransformerConfig and
  megatron's own FP8 context runs it. Needs CUDA and TE.
- `auto`: te with CUDA and TE installed (torch instead for a recipe TE cannot express:
  `run_backend`), else torch with CUDA, else emulated. One of our linears never runs te:
  for them `auto` is torch with CUDA, else emulated (`linear_backend`).

`resolve_backend` says which one a run gets and why (`calibclip info` prints it); the
trainer's config calls it, so a backend that cannot run here fails before anything starts.
A run on the CPU gets the emulation: `torch` is refused there (CPU torch has FP8
`_scaled_mm`, which the tests compare with the emulation, but no user wants it for a run).
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional

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
def _resolve(requested: str, cuda: bool, te: bool, scaled_mm: bool, *,
             for_run: bool = True) -> tuple[str, str]:
    """for_run: what a training run may use (config time); False: what one of our linears
    executes (the same answer, except that `torch` also runs on the CPU: the tests compare
    it with the emulation there, and `auto` is never te: a model with our linears was not
    built from TE's spec)."""
    if requested not in BACKEND_VALUES:
        raise ConfigError(f"fp8.backend: {requested!r} is not one of {list(BACKEND_VALUES)}")
    if requested == "emulated":
        return "emulated", "requested"
    if requested == "te":
        if not (cuda and te):
            missing = ", ".join(x for x, ok in (("a CUDA device", cuda), ("transformer-engine", te))
                                if not ok)
            instead = "'torch' or 'auto'" if cuda else "'emulated' or 'auto'"
            raise ConfigError(f"fp8.backend: 'te' needs a CUDA device and transformer-engine "
                              f"(missing here: {missing}); use {instead}")
        return "te", "requested"
    if requested == "torch":
        if not scaled_mm:
            raise ConfigError("fp8.backend: 'torch' needs torch._scaled_mm, which this torch "
                              f"({torch.__version__}) lacks")
        if for_run and not cuda:
            raise ConfigError("fp8.backend: 'torch' runs real FP8 GEMMs on a CUDA device and "
                              "there is none here; use 'emulated' or 'auto' on the CPU")
        return "torch", "requested"
    if cuda and te and for_run:  # the trainer then builds TE's layer spec
        return "te", "auto: CUDA and transformer-engine are available"
    if cuda and scaled_mm:
        why = "CUDA without transformer-engine" if not te else "CUDA, one of our linears"
        return "torch", f"auto: {why}, so torch._scaled_mm"
    return "emulated", "auto: no CUDA device, so the CPU emulation"


def resolve_backend(requested: str) -> tuple[str, str]:
    """(backend, why) for a run with `fp8.backend = requested` on this machine; ConfigError
    (one line) if the requested backend cannot run here."""
    return _resolve(requested, *_machine())


def te_refusal(recipe) -> Optional[str]:
    """Why Transformer Engine cannot run `recipe` (one line naming the alternative), or None."""
    from megatron_calibclip.fp8.te import te_config_kwargs

    try:
        te_config_kwargs(recipe)
    except ConfigError as err:
        return str(err)
    return None


def run_backend(requested: str, recipe=None, *, machine: Optional[tuple] = None
                ) -> tuple[str, str]:
    """(backend, why) for a run's FP8 section `recipe` (fp8.backend = requested): as
    `resolve_backend`, except that `auto` takes torch where TE cannot express the recipe
    (rowwise, a subset of linears), and an explicit `te` is refused for such a recipe in one
    line. machine: (CUDA, TE, _scaled_mm) to answer for another machine (the planner)."""
    cuda, te, scaled_mm = machine if machine is not None else _machine()
    backend, why = _resolve(requested, cuda, te, scaled_mm)
    if backend != "te" or recipe is None:
        return backend, why
    refusal = te_refusal(recipe)
    if refusal is None:
        return backend, why
    if requested == "te":
        raise ConfigError(f"fp8.backend: 'te' cannot run this recipe ({refusal}); set "
                          f"fp8.backend to 'torch' (real FP8 GEMMs through torch._scaled_mm) "
                          f"or 'emulated'")
    first = refusal.split(":")[0]
    return "torch", f"auto: CUDA and transformer-engine, but {first} has no TE recipe, so torch._scaled_mm"


def linear_backend(requested: str) -> str:
    """The backend one of our FP8 linears executes for `requested`: as a run would, except
    that `torch` also runs on the CPU (torch's CPU _scaled_mm; the tests use it)."""
    return _resolve(requested, *_machine(), for_run=False)[0]


def check_backend_supports(backend: str, granularity: str) -> None:
    """ConfigError when `backend` cannot run this scaling granularity. Only the torch backend
    lacks some: te's recipe (granularity and the rest) is checked by `run_backend`, the one
    place that resolves to te; the emulation runs every recipe."""
    if backend == "torch" and granularity not in TORCH_GRANULARITIES:
        raise ConfigError(
            f"fp8.backend resolves to 'torch' here, which runs {', '.join(TORCH_GRANULARITIES)} "
            f"scaling; {granularity!r} needs torch's block-scaled GEMMs, not wired yet: "
            f"install transformer-engine built for this torch (pip install "
            f"--no-build-isolation, docs/cluster.md; fp8.backend auto then takes te), or set "
            f"fp8.granularity to tensorwise or rowwise, or fp8.backend to "
            f"'emulated' (exact numerics, fp32 GEMMs: slow on a GPU)")
