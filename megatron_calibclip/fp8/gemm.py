"""The GEMM kernels our linears run, and which path runs them.

Why native BF16 kernels: a GPU multiplies BF16 (and FP8) operands with fp32 accumulation and
writes BF16, and so can this CPU (AVX-512 BF16: measured 2.3-2.9x faster than an fp32 GEMM
at the SmolLM2 step's shapes). The earlier emulation multiplied bf16-rounded or dequantized
values held in fp32 with fp32 GEMMs: the same products, 2-3x the time and a 4-byte copy of
every weight. Every value an FP8 recipe puts into a GEMM is exactly a BF16 number (an E4M3 /
E5M2 code, or a code times a power-of-two scale), so BF16 kernels lose nothing on them.

Two kernels:
- `bf16_linear`: BF16 inputs, fp32 accumulation, bias added to the fp32 sum, one rounding to
  BF16 at the end (a tensor core's BF16 output). Checked: torch's CPU kernel (oneDNN) rounds
  once, also with a bias (tests/fp8/test_gemm.py).
- `fp32_out_mm`: BF16-exact inputs, fp32 accumulation, **fp32 output**: for sums that a scale
  multiplies afterwards (an FP8 GEMM with fp32 scales: rounding the sum to BF16 before the
  scale would round twice, and differ from the GPU in ~26% of outputs by one BF16 step) and
  for weight gradients (fp32 main_grad, as megatron's fused wgrad accumulation). On CUDA:
  `torch.mm(..., out_dtype=torch.float32)` on BF16 operands (torch 2.13's `aten::mm.dtype`:
  CUDA kernel and Meta registration, fp32 output from fp16/bf16 inputs only). On the CPU
  torch has no BF16 GEMM with fp32 output; oneDNN's fp32 GEMM in BF16 "fpmath" mode is one
  (inputs converted to BF16, exact here since they are BF16 values; fp32 accumulation and
  output), ~1.2-1.7x faster than the plain fp32 GEMM; without oneDNN it is the fp32 GEMM.

`CALIBCLIP_GEMM` / `set_gemm_path`, three paths (fp8/native.py has the details), and "auto"
(the default): "native" where BF16 GEMMs are native (CUDA, AVX-512 BF16, AMX), else "fp32"
(`native_bf16_gemms`: on an AVX2-only CPU torch's BF16 GEMM is 8x slower than fp32).
- "native": every GEMM on the BF16 kernel, writing BF16 as a GPU model does
  (forward, dgrad, and wgrad as without gradient-accumulation fusion); an fp32 FP8 scale
  multiplies the BF16 sum (one more rounding, at most one BF16 step). Why not exact: CPU
  torch has no BF16 GEMM with fp32 output, and the one fp32-output route (oneDNN fpmath)
  runs at the fp32 GEMM's speed here; the extra rounding is ~30x smaller than an E4M3 step
  and smaller than Hopper's own FP8 fast-accumulation error.
- "exact": the fp32 emulation's results up to fp32 accumulation order, on BF16 kernels where
  that is free (BF16 mode forward and dgrad, power-of-two FP8 scales), the fp32-output
  kernel elsewhere.
- "fp32": the earlier emulation (fp32 GEMMs on rounded / dequantized values), the reference;
  `calibclip bench gemm` runs it beside "native".
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

GEMM_PATHS = ("auto", "native", "exact", "fp32")
_ENV = "CALIBCLIP_GEMM"
_path: Optional[str] = None


@functools.lru_cache(maxsize=1)
def native_bf16_gemms() -> tuple[bool, str]:
    """(whether BF16 GEMMs run on native hardware here, why): a CUDA device, or a CPU with
    AVX-512 BF16 or AMX tiles. Without them (e.g. an AVX2-only CPU) torch's CPU BF16 GEMM is
    an emulation: measured 8x slower than the fp32 GEMM at SmolLM2's shapes on an AMD EPYC
    (AVX2), against 2.3-2.9x faster on an AVX-512 BF16 CPU."""
    if torch.cuda.is_available():
        return True, "CUDA"
    cpu = getattr(torch, "cpu", None)
    checks = (("AVX-512 BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
    for name, check in checks:
        if getattr(cpu, check, lambda: False)():
            return True, f"this CPU has {name}"
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "unknown")()
    return False, f"this CPU ({capability}) has neither AVX-512 BF16 nor AMX"


def resolve_gemm_path(requested: str) -> tuple[str, str]:
    """(path, why) for a requested path; "auto" is "native" where BF16 GEMMs are native,
    else "fp32" (the emulation's fp32 GEMMs: the same results as "exact" up to accumulation
    order, and the fastest path where BF16 GEMMs are emulated)."""
    if requested != "auto":
        return requested, "requested"
    native, why = native_bf16_gemms()
    return ("native", f"auto: {why}") if native else ("fp32", f"auto: {why}, so fp32 GEMMs")


def requested_gemm_path() -> str:
    """set_gemm_path's, else $CALIBCLIP_GEMM, else "auto" (validated)."""
    if _path is not None:
        return _path
    value = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if value not in GEMM_PATHS:
        raise ValueError(f"{_ENV}={value!r} is not one of {list(GEMM_PATHS)}")
    return value


def gemm_path_and_why() -> tuple[str, str]:
    """(the path in force, why): the requested one, "auto" resolved (calibclip info,
    resolved.yaml)."""
    return resolve_gemm_path(requested_gemm_path())


def gemm_path() -> str:
    """The path in force ("native", "exact" or "fp32"): the requested one, "auto" resolved."""
    return gemm_path_and_why()[0]


def set_gemm_path(path: Optional[str]) -> None:
    """Override the path for this process (None: back to the environment's)."""
    global _path
    if path is not None and path not in GEMM_PATHS:
        raise ValueError(f"GEMM path {path!r} is not one of {list(GEMM_PATHS)}")
    _path = path


@contextlib.contextmanager
def using_gemm_path(path: str) -> Iterator[None]:
    """`with using_gemm_path("fp32"): ...` (restored afterwards, also on error)."""
    global _path
    previous = _path
    set_gemm_path(path)
    try:
        yield
    finally:
        _path = previous


def bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """BF16 [m, n] = x [m, K] @ w [n, K]^T (+ bias), fp32 accumulation, one rounding."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"bf16_linear takes bf16 operands, got {x.dtype} and {w.dtype}")
    return F.linear(x, w, None if bias is None else bias.to(torch.bfloat16))


def _onednn_bf16_fpmath() -> bool:
    """Whether this torch routes fp32 CPU GEMMs through oneDNN's BF16 fpmath mode."""
    mkldnn = torch.backends.mkldnn
    return (mkldnn.is_available() and hasattr(mkldnn, "matmul")
            and hasattr(mkldnn.matmul, "fp32_precision"))


@contextlib.contextmanager
def _cpu_bf16_fpmath() -> Iterator[None]:
    matmul = torch.backends.mkldnn.matmul
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


def fp32_out_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 [m, n] = a [m, K] @ b [n, K]^T for operands that hold BF16 values (any float
    dtype): exact products, fp32 accumulation, fp32 output (no rounding of the sum)."""
    if a.device.type != "cpu":  # CUDA (and the meta device): aten::mm.dtype, bf16 -> fp32
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16).t(), out_dtype=torch.float32)
    a32, b32 = a.float(), b.float()
    if _onednn_bf16_fpmath():
        with _cpu_bf16_fpmath():
            return a32 @ b32.t()
    return a32 @ b32.t()
