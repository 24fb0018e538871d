"""(a) Our FP8 quantizer and the `torch` backend's FP8 GEMMs at K = 4096 and 12288 (the
reduction lengths of an 8B-class model's projections), tensorwise / rowwise / blockwise.

Why: the `torch` backend and the emulation share fp8/quantize.py, so the GPU's FP8 GEMMs see
our codes. Each case checks them against references that do not come from that quantizer
(references.py):
- `gemm`: the FP8 GEMM on our codes (the package's `scaled_mm`; blockwise through torch's
  block-scaled `F.scaled_mm`, 1x128 x 128x128) against the float64 product of the ORIGINAL
  operands, x.double() @ w.double().T; its relative error must lie within the band that
  e4m3 rounding explains (references.fp8_gemm_noise: at most 1.5x the derived RMS, and at
  least 0.25x of it, i.e. the GEMM really ran on FP8 codes);
- `te_reference`: our codes and scales equal Transformer Engine's own quantizers bit for
  bit (tensorwise, blockwise; TE has no full-row quantizer for rowwise);
- `formula`: our codes against the same formula written out again (not independent: a
  guard against a slip in the quantizer, recorded as such).
Not run is a failure, except on a `--smoke` CPU run: no TE there, and CPU torch has no
block-scaled GEMM kernel (runner/verdict.py); on a GPU other than Hopper torch's blockwise
GEMM does not exist ("DeepSeek style (1x128, 128x128) scaling only supported in CUDA for
SM90", ScaledBlas.cpp _check_deepseek_support): recorded as not supported by this GPU.
"""
from __future__ import annotations

import torch

from megatron_calibclip.bench.gpu_check.common import (
    CPU_NO_BLOCK_SCALED_MM,
    NOT_SUPPORTED_BY_THIS_GPU,
    case_error,
    cases_passed,
    gpu_capability,
    not_run,
    rel_fro,
    te_unavailable,
)
from megatron_calibclip.bench.gpu_check.options import CheckOptions
from megatron_calibclip.bench.gpu_check.references import (
    BLOCK,
    compare_codes,
    formula_quantize,
    fp8_gemm_noise,
    te_quantize,
)
from megatron_calibclip.parallel.devices import HOST

GRANULARITIES = ("tensorwise", "rowwise", "blockwise")
THRESHOLDS = {
    "code_mismatch_fraction_max": 0.0,  # our codes equal the reference's, bit for bit
    "scale_rel_diff_max": 0.0,  # and so do the scales
    # rel. Frobenius error vs the float64 product of the original operands, over the RMS
    # that e4m3 rounding explains (references.fp8_gemm_noise; a correct GEMM: ~0.7)
    "gemm_error_over_fp8_noise_max": 1.5,
    "gemm_error_over_fp8_noise_min": 0.25,
}
REFERENCE = ("GEMM: float64 product of the original operands, within the e4m3 rounding "
             "noise derived in references.fp8_gemm_noise; codes/scales: Transformer "
             "Engine's quantizers bit for bit; formula: the same formula re-written (not "
             "independent)")


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


def _codes_within(result: dict) -> bool:
    return all(result[r]["code_mismatch_fraction"] <= THRESHOLDS["code_mismatch_fraction_max"]
               and result[r]["scale_rel_diff"] <= THRESHOLDS["scale_rel_diff_max"]
               for r in ("activation", "weight"))


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


def _gemm_refusal(err: Exception, granularity: str, device: str) -> dict:
    """The not-run record of a GEMM torch refused: a CPU limitation (blockwise on the CPU),
    this GPU's (blockwise off Hopper), or a failure."""
    why = f"torch refused the {granularity} GEMM: {type(err).__name__}: {str(err)[:300]}"
    if granularity == "blockwise" and device == "cpu":
        return not_run(why, CPU_NO_BLOCK_SCALED_MM)
    capability = gpu_capability(device)
    if granularity == "blockwise" and capability is not None and capability[0] != 9:
        return not_run(why, NOT_SUPPORTED_BY_THIS_GPU, capability=list(capability))
    return not_run(why)


def gemm_case(opts: CheckOptions, x, w, granularity: str, ours: tuple) -> dict:
    """The FP8 GEMM on our codes vs the float64 product of the original operands."""
    from megatron_calibclip.fp8.scaled_mm import scaled_mm

    (qx, x_codes, x_si), (qw, w_codes, w_si) = ours
    m, n = x.shape[0], w.shape[0]
    try:
        if granularity == "blockwise":
            got = _blockwise_gemm(x_codes, x_si, w_codes, w_si)
        else:  # the package's `torch` backend GEMM (rowwise writes BF16: CUDA's kernel)
            got = scaled_mm(qx, qw, m, n, granularity)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as err:
        return _gemm_refusal(err, granularity, opts.device)
    want = x.double() @ w.double().t()
    noise = fp8_gemm_noise(x, w, got.dtype, want)
    error = rel_fro(got, want)
    out = {"ran": True, "out_dtype": str(got.dtype), "rel_fro_vs_fp64_original": error,
           "fp8_noise_rms": noise, "error_over_noise": error / noise}
    out["passed"] = (THRESHOLDS["gemm_error_over_fp8_noise_min"] <= out["error_over_noise"]
                     <= THRESHOLDS["gemm_error_over_fp8_noise_max"])
    return out


def te_case(opts: CheckOptions, x, w, granularity: str, ours: tuple) -> dict:
    """Our codes and scales vs Transformer Engine's quantizers, bit for bit."""
    missing = te_unavailable(opts.device)
    if missing is not None:
        return missing
    out: dict = {"ran": True}
    try:
        for role, tensor, (_, codes, si) in (("activation", x, ours[0]), ("weight", w, ours[1])):
            te_codes, te_si = te_quantize(tensor, granularity, role)
            out[role] = compare_codes(codes, te_codes, si, te_si)
    except Exception as err:  # noqa: BLE001 - TE's API moves between releases: a failure
        return case_error(err)
    out["passed"] = _codes_within(out)
    return out


def check_case(opts: CheckOptions, k: int, granularity: str) -> dict:
    gen = torch.Generator(device=HOST).manual_seed(k)  # the same operands on any device
    m, n = opts.gemm_m, opts.gemm_n
    x = (torch.randn(m, k, generator=gen, device=HOST)
         * torch.linspace(0.05, 4.0, m, device=HOST).unsqueeze(1))
    x[:, :: max(k // 7, 1)] *= 20  # outlier channels, as real activations have
    w = torch.randn(n, k, generator=gen, device=HOST) * 0.02
    x, w = x.to(opts.device), w.to(opts.device)
    ours = (_ours(x, granularity, "activation"), _ours(w, granularity, "weight"))
    formula: dict = {"ran": True, "independent": False}
    for role, tensor, (_, codes, si) in (("activation", x, ours[0]), ("weight", w, ours[1])):
        ref_codes, ref_si = formula_quantize(tensor, granularity, role)
        formula[role] = compare_codes(codes, ref_codes, si, ref_si)
    formula["passed"] = _codes_within(formula)
    out: dict = {"ran": True, "m": m, "n": n, "k": k, "formula": formula,
                 "gemm": gemm_case(opts, x, w, granularity, ours)}
    if granularity == "rowwise":
        out["te_reference"] = "none: Transformer Engine has no full-row (1 x K) quantizer"
    else:
        out["te_reference"] = te_case(opts, x, w, granularity, ours)
    out["passed"] = cases_passed({key: value for key, value in out.items()
                                  if isinstance(value, dict) and "ran" in value})
    return out


def run(opts: CheckOptions) -> dict:
    cases = {}
    for k in opts.k_values:
        for granularity in GRANULARITIES:
            key = f"K{k}/{granularity}"
            try:
                cases[key] = check_case(opts, k, granularity)
            except Exception as err:  # noqa: BLE001 - one case's failure is its own record
                cases[key] = case_error(err)
    return {"ran": True, "reference": REFERENCE, "thresholds": THRESHOLDS, "cases": cases,
            "passed": cases_passed(cases)}
