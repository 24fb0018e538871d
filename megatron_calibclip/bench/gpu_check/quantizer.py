"""(a) Our quantizer against the backend's own FP8 codes, scales and GEMMs, at K = 4096 and
12288 (the reduction lengths of an 8B-class model's projections).

Why: the `torch` backend and the emulation share fp8/quantize.py, so the GPU's FP8 GEMMs see
our codes; this checks, on the device, that those codes and scales are the ones the backend
would have made itself (torch/torchao's formula written out independently below, and TE's
quantizer when it imports), and that `torch._scaled_mm` on them computes the product of the
dequantized operands. Blockwise GEMMs go through torch's block-scaled `F.scaled_mm` where
this torch and GPU have it; otherwise the case records "unsupported" with torch's reason.
"""
from __future__ import annotations

import importlib.util

import torch

from megatron_calibclip.bench.gpu_check.common import error_record, rel_fro
from megatron_calibclip.bench.gpu_check.options import CheckOptions
from megatron_calibclip.parallel.devices import HOST

E4M3_MAX = 448.0
BLOCK = 128
GRANULARITIES = ("tensorwise", "rowwise", "blockwise")
THRESHOLDS = {
    "code_mismatch_fraction_max": 0.0,  # our codes equal the backend's, bit for bit
    "scale_rel_diff_max": 0.0,  # and so do the scales
    # ||scaled_mm - dequant(x) @ dequant(W)^T||_F / ||ref||_F; fp32 output (tensorwise,
    # rowwise) allows for the tensor cores' accumulator, bf16 output (blockwise) for its rounding
    "gemm_rel_fro_fp32_out_max": 1e-3,
    "gemm_rel_fro_bf16_out_max": 1e-2,
}


def _reference_scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """scale = 448 / amax as one correctly rounded fp32 division (TE's kernels; amax 0 -> 1);
    pow2 rounds it down to a power of two (DeepSeek-style blocks). Not `448.0 / amax` in
    Python: torch computes that as reciprocal(amax) * 448, one ulp off now and then, which
    moves a few codes (measured: 2 of 1.5M at K = 12288)."""
    amax = amax.float()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = torch.where(amax > 0, torch.full_like(amax, E4M3_MAX) / safe, torch.ones_like(amax))
    if pow2:
        _, exponent = torch.frexp(scale)  # scale = m * 2**e with m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def reference_quantize(x: torch.Tensor, granularity: str, role: str):
    """(codes [rows, K] e4m3, scale_inv as _scaled_mm takes it) computed the backend's way."""
    rows, k = x.shape
    if granularity == "tensorwise":
        scale = _reference_scale(x.abs().amax(), False)
        full = scale
    elif granularity == "rowwise":
        scale = _reference_scale(x.abs().amax(dim=1, keepdim=True), False)
        full = scale
    elif role == "activation":  # blockwise 1 x 128 tiles along K
        scale = _reference_scale(x.abs().reshape(rows, k // BLOCK, BLOCK).amax(-1), True)
        full = scale.repeat_interleave(BLOCK, dim=1)
    else:  # blockwise 128 x 128 weight blocks
        blocks = x.abs().reshape(rows // BLOCK, BLOCK, k // BLOCK, BLOCK).amax(dim=(1, 3))
        scale = _reference_scale(blocks, True)
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    codes = (x.float() * full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, torch.ones_like(scale) / scale


def _ours(x: torch.Tensor, granularity: str, role: str):
    from megatron_calibclip.fp8 import FP8Recipe, quantize

    q = quantize(x, FP8Recipe(granularity=granularity), role)
    codes = q.unblock(q.data).contiguous()
    rows, k = x.shape
    if granularity == "tensorwise":
        scale_inv = q.scale_inv.reshape(())
    elif granularity == "rowwise":
        scale_inv = q.scale_inv.reshape(rows, 1)
    elif role == "activation":
        scale_inv = q.scale_inv.reshape(rows, k // BLOCK)
    else:
        scale_inv = q.scale_inv.reshape(rows // BLOCK, k // BLOCK)
    return q, codes, scale_inv


def _compare_codes(ours, ref, ours_si, ref_si) -> dict:
    mismatch = (ours.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
    scale = ((ours_si.double() - ref_si.double()).abs() / ref_si.double().abs()).max().item()
    return {"code_mismatch_fraction": mismatch, "scale_rel_diff": scale}


def _blockwise_gemm(x_codes, x_si, w_codes, w_si) -> torch.Tensor:
    """1x128 activations x 128x128 weights through torch's block-scaled GEMM (bf16 out)."""
    import torch.nn.functional as F

    scaling = getattr(F, "ScalingType", None)
    if not hasattr(F, "scaled_mm") or scaling is None or not hasattr(scaling, "BlockWise1x128"):
        raise NotImplementedError(f"torch {torch.__version__} has no F.scaled_mm with "
                                  f"ScalingType.BlockWise1x128 / BlockWise128x128")
    swizzle = getattr(F, "SwizzleType", None)
    no_swizzle = {} if swizzle is None else {"swizzle_a": swizzle.NO_SWIZZLE,
                                             "swizzle_b": swizzle.NO_SWIZZLE}
    scale_a = x_si.float().t().contiguous().t()  # [M, K/128], M-major as cuBLAS wants
    scale_b = w_si.float().t()  # [K/128, N/128] view of the [N/128, K/128] block scales
    return F.scaled_mm(x_codes, w_codes.t(), scale_a, scaling.BlockWise1x128, scale_b,
                       scaling.BlockWise128x128, output_dtype=torch.bfloat16, **no_swizzle)


def _te_tensorwise(x: torch.Tensor) -> dict:
    """Transformer Engine's current-scaling quantizer on the same tensor (when TE imports)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return {"skipped": "transformer_engine is not installed here"}
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

        quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=x.device)
        qt = quantizer(x)
        _, codes, scale_inv = _ours(x, "tensorwise", "activation")
        te_codes = qt._data.view(torch.float8_e4m3fn)
        return _compare_codes(codes, te_codes, scale_inv, qt._scale_inv.reshape(()))
    except Exception as err:  # noqa: BLE001 - TE's private API moves between releases
        return {"error": error_record(err)}


def check_case(opts: CheckOptions, k: int, granularity: str) -> dict:
    from megatron_calibclip.fp8.scaled_mm import scaled_mm

    gen = torch.Generator(device=HOST).manual_seed(k)  # the same operands on any device
    m, n = opts.gemm_m, opts.gemm_n
    x = (torch.randn(m, k, generator=gen, device=HOST)
         * torch.linspace(0.05, 4.0, m, device=HOST).unsqueeze(1))
    x[:, :: max(k // 7, 1)] *= 20  # outlier channels, as real activations have
    w = torch.randn(n, k, generator=gen, device=HOST) * 0.02
    x, w = x.to(opts.device), w.to(opts.device)
    out: dict = {"m": m, "n": n, "k": k}
    qx, x_codes, x_si = _ours(x, granularity, "activation")
    qw, w_codes, w_si = _ours(w, granularity, "weight")
    rx_codes, rx_si = reference_quantize(x, granularity, "activation")
    rw_codes, rw_si = reference_quantize(w, granularity, "weight")
    out["activation"] = _compare_codes(x_codes, rx_codes, x_si, rx_si)
    out["weight"] = _compare_codes(w_codes, rw_codes, w_si, rw_si)
    want = qx.dequantize().double() @ qw.dequantize().double().t()
    try:
        if granularity == "blockwise":
            got = _blockwise_gemm(x_codes, x_si, w_codes, w_si)
            limit = THRESHOLDS["gemm_rel_fro_bf16_out_max"]
        else:
            got = scaled_mm(qx, qw, m, n, granularity)  # the package's `torch` backend GEMM
            limit = THRESHOLDS["gemm_rel_fro_bf16_out_max" if granularity == "rowwise"
                               else "gemm_rel_fro_fp32_out_max"]  # rowwise GEMMs write BF16
        out["gemm"] = {"out_dtype": str(got.dtype), "rel_fro": rel_fro(got, want)}
        gemm_ok = out["gemm"]["rel_fro"] <= limit
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:
        out["gemm"] = {"unsupported": error_record(err)}
        gemm_ok = granularity == "blockwise"  # no blockwise backend yet: recorded, not failed
    codes_ok = all(out[r]["code_mismatch_fraction"] <= THRESHOLDS["code_mismatch_fraction_max"]
                   and out[r]["scale_rel_diff"] <= THRESHOLDS["scale_rel_diff_max"]
                   for r in ("activation", "weight"))
    out["passed"] = codes_ok and gemm_ok
    return out


def run(opts: CheckOptions) -> dict:
    cases = {}
    for k in opts.k_values:
        for granularity in GRANULARITIES:
            key = f"K{k}/{granularity}"
            try:
                cases[key] = check_case(opts, k, granularity)
            except Exception as err:  # noqa: BLE001 - one case's failure is its own record
                cases[key] = {"error": error_record(err), "passed": False}
    gen = torch.Generator(device=HOST).manual_seed(1)
    x = torch.randn(opts.gemm_m, opts.k_values[0], generator=gen, device=HOST)
    te = _te_tensorwise(x.to(opts.device))
    te_ok = "error" not in te and ("skipped" in te or (
        te["code_mismatch_fraction"] <= THRESHOLDS["code_mismatch_fraction_max"]))
    return {"thresholds": THRESHOLDS, "cases": cases, "transformer_engine_tensorwise": te,
            "passed": te_ok and all(c["passed"] for c in cases.values())}
