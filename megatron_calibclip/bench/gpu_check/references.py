"""References for section (a) that do not come from our quantizer (fp8/quantize.py):

- `fp8_gemm_noise`: how far an e4m3 x e4m3 GEMM may land from the float64 product of the
  ORIGINAL operands, derived from the format alone (the derivation is in its docstring);
- `te_quantize`: Transformer Engine's own quantizers (when TE imports, on CUDA), whose codes
  and scales ours must equal bit for bit;
- `formula_quantize`: the torchao / TE formula written out once more. It is NOT
  independent (the same arithmetic as fp8/quantize.py, by the same hands): it catches a
  slip in a refactoring of the quantizer, not a misunderstanding shared by both.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

E4M3_MAX = 448.0
BLOCK = 128


def fp8_gemm_noise(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                   product: Optional[torch.Tensor] = None) -> float:
    """The RMS relative Frobenius error ||Y_fp8 - X W^T||_F / ||X W^T||_F that rounding both
    operands to e4m3 (with any of our scalings) and accumulating in fp32 is expected to
    cause, as an upper estimate. x [m, K], w [n, K], the original high-precision operands;
    product: x.double() @ w.double().T if the caller has it.

    Derivation. An operand element v is stored as code * scale_inv, code = RNE(v * s) in
    e4m3, s > 0 the scale of v's scaling block (tensor, row, 1x128 tile or 128x128 block).
    - Normal codes (|v s| >= 2^-6): e4m3 has 3 mantissa bits, so in a binade [2^e, 2^(e+1))
      codes are 2^(e-3) apart and round-to-nearest moves a value by at most 2^(e-4): the
      relative error is at most u = 2^-4. The error is ~uniform over that interval, with
      variance (2^(e-3))^2 / 12 = 2^(2e) u^2 / 3 <= v^2 u^2 / 3 (as |v| >= 2^e).
    - Subnormal codes (|v s| < 2^-6): spacing 2^-9, error uniform within +-2^-10, variance
      2^-18 / 12 in code units, (2^-9 / s)^2 / 12 in value units. Every scaling maps its
      block's amax to 448, rounded down to a power of two at most (blockwise): s >=
      448 / (2 amax_block) >= 448 / (2 amax), amax over the whole operand. So the variance is
      at most a^2 = (2^-8 amax / 448)^2 / 12.
    - No overflow: the block's amax maps to exactly 448, the largest finite e4m3.
    Each element so carries an error e with zero mean, independent of the others, and
    Var(e) <= v^2 u^2 / 3 + a^2 (both bounds added, covering either regime).
    The GEMM error is E = E_x W^T + X E_w^T + E_x E_w^T. Independent zero-mean errors make
    the cross terms vanish in expectation, and for the first term
      E ||E_x W^T||_F^2 = sum_ij sum_k Var(e_x[i,k]) w[j,k]^2
                        = sum_k (sum_i Var(e_x[i,k])) (sum_j w[j,k]^2),
    the second likewise with the roles swapped, the third sum_k Vx_k Vw_k. The GEMM's own
    arithmetic adds the output rounding (relative <= eps/2 of the output dtype: variance
    <= (eps/2)^2 / 3 ||Y||^2; bf16 2^-8, fp32 2^-24) and fp32 accumulation over K terms
    (random-walk ~sqrt(K) 2^-24 relative, ~1e-5 at K = 12288: included, negligible).
    The result, sqrt(sum) / ||X W^T||_F, is ~u sqrt(2/3) ~ 0.05 for operands without
    subnormals. Within a binade the actual variance averages ~0.54 of the bound (log-uniform
    mantissas: E[1/m^2] over [1, 2) = 3 / (8 ln 2)), so a correct FP8 GEMM measures ~0.7 x
    this number (measured on the CPU: 0.70-0.74 for tensorwise, rowwise and blockwise
    codes at K = 4096 and 12288); a GEMM that skipped the quantization would measure ~1e-6
    (fp32 arithmetic alone), one that dropped a scale ~1.
    """
    u = 2.0 ** -4
    x, w = x.double(), w.double()
    y = product.double() if product is not None else x @ w.t()
    y_sq = y.square().sum()

    def element_var_sums(v: torch.Tensor, rows: int) -> torch.Tensor:
        a_sq = (2.0 ** -8 * v.abs().max() / E4M3_MAX) ** 2 / 12
        return v.square().sum(0) * u * u / 3 + rows * a_sq  # [K]: sum over rows of Var(e)

    vx, vw = element_var_sums(x, x.shape[0]), element_var_sums(w, w.shape[0])
    x_sq, w_sq = x.square().sum(0), w.square().sum(0)
    quant = (vx * w_sq).sum() + (x_sq * vw).sum() + (vx * vw).sum()
    half_eps = torch.finfo(out_dtype).eps / 2
    arithmetic = y_sq * (half_eps ** 2 / 3 + x.shape[1] * 2.0 ** -48)
    return math.sqrt((quant + arithmetic).item() / max(y_sq.item(), 1e-300))


def _formula_scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """scale = 448 / amax as one correctly rounded fp32 division (TE's kernels; amax 0 -> 1);
    pow2 rounds it down to a power of two (DeepSeek-style blocks). Not `448.0 / amax` in
    Python: torch computes that as reciprocal(amax) * 448, one ulp off now and then."""
    amax = amax.float()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = torch.where(amax > 0, torch.full_like(amax, E4M3_MAX) / safe, torch.ones_like(amax))
    if pow2:
        _, exponent = torch.frexp(scale)  # scale = m * 2**e with m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def formula_quantize(x: torch.Tensor, granularity: str, role: str):
    """(codes [rows, K] e4m3, scale_inv in our layout) by the formula (see module doc)."""
    rows, k = x.shape
    if granularity == "tensorwise":
        scale = full = _formula_scale(x.abs().amax(), False)
    elif granularity == "rowwise":
        scale = full = _formula_scale(x.abs().amax(dim=1, keepdim=True), False)
    elif role == "activation":  # blockwise 1 x 128 tiles along K
        scale = _formula_scale(x.abs().reshape(rows, k // BLOCK, BLOCK).amax(-1), True)
        full = scale.repeat_interleave(BLOCK, dim=1)
    else:  # blockwise 128 x 128 weight blocks
        blocks = x.abs().reshape(rows // BLOCK, BLOCK, k // BLOCK, BLOCK).amax(dim=(1, 3))
        scale = _formula_scale(blocks, True)
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    codes = (x.float() * full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, torch.ones_like(scale) / scale


def te_quantize(x: torch.Tensor, granularity: str, role: str) -> Optional[tuple]:
    """(codes [rows, K] e4m3, scale_inv in our layout) from Transformer Engine's own
    quantizer, or None for a granularity TE has no quantizer for (rowwise: one scale per
    full row of K exists in torch/torchao, not in TE). Needs TE and a CUDA tensor.

    Checked against TE's source (NVIDIA/TransformerEngine, transformer_engine/pytorch/
    tensor/): Quantizer.__call__(tensor) -> quantize (quantized_tensor.py);
    Float8CurrentScalingQuantizer(fp8_dtype, device, *, rowwise, columnwise,
    force_pow_2_scales=False, amax_epsilon=0.0) -> Float8Tensor with `_data` (uint8) and
    `_scale_inv` [1] (float8_tensor.py); Float8BlockQuantizer(fp8_dtype, *, rowwise,
    columnwise, amax_epsilon=0.0, force_pow_2_scales=True, block_scaling_dim=2) ->
    Float8BlockwiseQTensor with `_rowwise_data` and `_rowwise_scale_inv` in GEMM-ready
    layout (float8_blockwise_tensor.py get_scale_shape: 1-D [ceil(K/128), M padded to 4],
    2-D [ceil(M/128), ceil(K/128) padded to 4]; storage/float8_blockwise_tensor_storage.py
    dequantize slices and transposes them the same way as below)."""
    import transformer_engine_torch as tex

    rows, k = x.shape
    e4m3 = tex.DType.kFloat8E4M3
    if granularity == "tensorwise":
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

        qt = Float8CurrentScalingQuantizer(e4m3, device=x.device, rowwise=True,
                                           columnwise=False)(x)
        return qt._data.view(torch.float8_e4m3fn), qt._scale_inv.reshape(())
    if granularity != "blockwise":
        return None
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    dim = 1 if role == "activation" else 2
    qt = Float8BlockQuantizer(e4m3, rowwise=True, columnwise=False, amax_epsilon=0.0,
                              force_pow_2_scales=True, block_scaling_dim=dim)(x)
    si = qt._rowwise_scale_inv
    if dim == 1:  # [K/128, M padded] -> ours [M, K/128]
        si = si[:, :rows].t()
    else:  # [M/128, K/128 padded] -> ours [M/128, K/128]
        si = si[:, : k // BLOCK]
    return qt._rowwise_data.view(torch.float8_e4m3fn), si.contiguous()


def compare_codes(ours, ref, ours_si, ref_si) -> dict[str, float]:
    """Fraction of differing codes (bitwise) and the largest relative scale difference."""
    if tuple(ours.shape) != tuple(ref.shape) or tuple(ours_si.shape) != tuple(ref_si.shape):
        raise ValueError(f"layouts differ: codes {tuple(ours.shape)} vs {tuple(ref.shape)}, "
                         f"scales {tuple(ours_si.shape)} vs {tuple(ref_si.shape)}")
    mismatch = (ours.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
    scale = ((ours_si.double() - ref_si.double()).abs() / ref_si.double().abs()).max().item()
    return {"code_mismatch_fraction": mismatch, "scale_rel_diff": scale}
