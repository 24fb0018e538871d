"""Quantize / dequantize a tensor the way an FP8 recipe does on the GPU.

Why per-granularity block layouts: the scale is shared by a group of elements (the tensor,
a row, a 1x128 tile, a 128x128 block, a 1x32 MX block), and which elements share it is
exactly what decides how a token's rounding depends on other tokens (batch coupling) or on
the rest of a weight (re-quantization jumps). A tensor is viewed as [groups..., members],
the amax is taken over each group, the scale follows fp8/scales.py, and the values are
rounded through torch's float8 casts (RNE, saturating).

`axis` is the GEMM reduction (K) dimension the groups run along. For y = x W^T with
x [tokens, in] and W [out, in]: forward uses axis=-1 for both; dgrad (dy W) uses dy along
-1 and W along 0; wgrad (dy^T x) uses dy and x along 0 (tokens). TE computes each of these
"rowwise" / "columnwise" copies from the high-precision tensor, and so do we.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron_calibclip.fp8.delayed import AmaxHistory
from megatron_calibclip.fp8.formats import cast_to_fp8
from megatron_calibclip.fp8.recipe import BLOCK, MX_BLOCK, FP8Recipe, Role, _check_role
from megatron_calibclip.fp8.scales import (
    current_scale,
    e8m0_exponent,
    e8m0_scale,
    e8m0_scale_inv,
    reciprocal,
)


class NonFiniteError(ValueError):
    """A tensor handed to FP8 quantization holds NaN or inf.

    Transformer Engine would propagate a NaN silently (and saturate an inf to the format's
    max); the emulation stops instead and says which operand it was, since a non-finite
    activation, weight or gradient is always a bug upstream of the GEMM."""


@dataclass
class Quantized:
    """FP8 data in its block layout, with the dequantization multipliers of each block."""

    data: torch.Tensor  # float8 values, shape [groups..., members] (block layout)
    scale_inv: torch.Tensor  # fp32, broadcastable against `data`; value = data * scale_inv
    unblock: Callable[[torch.Tensor], torch.Tensor]  # block layout -> original shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.unblock(self.data.float() * self.scale_inv).to(dtype)

    @property
    def scale(self) -> torch.Tensor:
        """The quantization multipliers (1 / scale_inv), for inspection."""
        return reciprocal(self.scale_inv)


def _whole(x: torch.Tensor):
    shape = x.shape
    return x.reshape(1, -1), lambda b: b.reshape(shape)


def _rows(x: torch.Tensor, axis: int):
    """[..., n along axis] -> [rows, n]: one group per line along `axis`."""
    xt = x.movedim(axis, -1)
    tshape = xt.shape
    return xt.reshape(-1, tshape[-1]), lambda b: b.reshape(tshape).movedim(-1, axis)


def _tiles_1d(x: torch.Tensor, axis: int, size: int):
    """Lines along `axis` cut into 1 x size tiles; the last tile of a line may be partial
    (zero padding does not change an amax)."""
    rows, unrow = _rows(x, axis)
    r, n = rows.shape
    nb = -(-n // size)
    if nb * size != n:
        rows = F.pad(rows, (0, nb * size - n))

    def unblock(b: torch.Tensor) -> torch.Tensor:
        return unrow(b.reshape(r, nb * size)[:, :n])

    return rows.reshape(r, nb, size), unblock


def _tiles_2d(x: torch.Tensor, size: int):
    """A 2-D tensor cut into size x size blocks (partial blocks at the edges)."""
    if x.dim() != 2:
        raise ValueError(f"blockwise weight quantization needs a 2-D tensor, got {tuple(x.shape)}")
    m, n = x.shape
    mb, nb = -(-m // size), -(-n // size)
    if (mb * size, nb * size) != (m, n):
        x = F.pad(x, (0, nb * size - n, 0, mb * size - m))

    def unblock(b: torch.Tensor) -> torch.Tensor:
        return b.reshape(mb * size, nb * size)[:m, :n]

    return x.reshape(mb, size, nb, size), unblock


def _block_view(x: torch.Tensor, recipe: FP8Recipe, role: Role, axis: int):
    """(blocks, reduce_dims, unblock) for this granularity and role."""
    g = recipe.granularity
    if g in ("tensorwise", "delayed"):
        blocks, unblock = _whole(x)
        return blocks, (-1,), unblock
    if g == "rowwise":
        blocks, unblock = _rows(x, axis)
        return blocks, (-1,), unblock
    if g == "blockwise":
        if role == "weight":
            blocks, unblock = _tiles_2d(x, BLOCK)
            return blocks, (1, 3), unblock
        blocks, unblock = _tiles_1d(x, axis, BLOCK)
        return blocks, (-1,), unblock
    if g == "mxfp8":
        blocks, unblock = _tiles_1d(x, axis, MX_BLOCK)
        return blocks, (-1,), unblock
    raise ValueError(f"unknown granularity {g!r}")


def _check_finite(x: torch.Tensor, amax: torch.Tensor, recipe: FP8Recipe, role: Role,
                  axis: int) -> None:
    """NaN/inf in `x` (amax is NaN/inf iff a block holds one). On the CPU: NonFiniteError
    naming the tensor. On an accelerator: a device-side assert (`torch._assert_async`), so
    that quantizing never waits for the device (a host read here would stall every GEMM's
    operand, every decode step); the run still stops at the first non-finite operand."""
    if amax.device.type == "cpu":
        if not bool(torch.isfinite(amax).all()):
            bad = int((~torch.isfinite(x.detach())).sum())
            raise NonFiniteError(
                f"quantize: {role} tensor of shape {list(x.shape)} has {bad} non-finite value(s) "
                f"(NaN/inf); FP8 scaling needs finite inputs ({recipe.granularity}, axis={axis})")
        return
    torch._assert_async(torch.isfinite(amax).all(),
                        f"quantize: {role} tensor has NaN/inf; FP8 scaling needs finite inputs")


def quantize(
    x: torch.Tensor,
    recipe: FP8Recipe,
    role: Role = "activation",
    *,
    axis: int = -1,
    state: Optional[AmaxHistory] = None,
) -> Quantized:
    """Quantize `x` for one GEMM operand. `state` is required (and updated) for "delayed".

    Raises NonFiniteError if `x` holds NaN or inf (before any delayed-scaling update)."""
    _check_role(role)
    fmt = recipe.element_format(role)
    blocks, dims, unblock = _block_view(x.detach().float(), recipe, role, axis)
    amax = blocks.abs().amax(dim=dims, keepdim=True)
    _check_finite(x, amax, recipe, role, axis)
    if recipe.granularity == "mxfp8":
        exponent = e8m0_exponent(amax, fmt)
        data = cast_to_fp8(blocks * e8m0_scale(exponent), fmt)
        return Quantized(data, e8m0_scale_inv(exponent), unblock)
    if recipe.granularity == "delayed":
        if state is None:
            raise ValueError(
                "delayed scaling needs the tensor's AmaxHistory: pass state=... "
                "(an emulated linear keeps one per role)"
            )
        scale = state.quantize_scale().to(blocks.device).reshape(1, 1)
        state.record(amax)  # after the scale was taken: the next step uses this amax
    else:
        scale = current_scale(amax, fmt, recipe.pow2_scales)
    data = cast_to_fp8(blocks * scale, fmt)
    return Quantized(data, reciprocal(scale), unblock)


def quantize_dequantize(
    x: torch.Tensor,
    recipe: FP8Recipe,
    role: Role = "activation",
    *,
    axis: int = -1,
    state: Optional[AmaxHistory] = None,
) -> torch.Tensor:
    """What the GEMM sees of `x`: quantized with `recipe` and dequantized; same shape and
    dtype as `x` (computed in fp32). Not differentiable (the result is detached): training
    goes through the emulated linears, whose backward quantizes gradients as TE does."""
    return quantize(x, recipe, role, axis=axis, state=state).dequantize(x.dtype)


def same_both_ways(recipe: FP8Recipe, role: Role) -> bool:
    """True when the copy quantized along axis 0 equals the one along -1 (one scale per
    tensor, or square 128x128 weight blocks), so it need not be computed twice."""
    g = recipe.granularity
    return g in ("tensorwise", "delayed") or (g == "blockwise" and role == "weight")
