"""quantize_dequantize against values worked out by hand (grids, scales, ties, saturation).

E4M3 grid reminders: 3 mantissa bits, so [1, 2) has step 1/8, [32, 64) step 4, [128, 256)
step 16, [256, 448] step 32; smallest subnormal 2**-9. E5M2: 2 mantissa bits, so [2048, 4096)
has step 512; max 57344.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_calibclip.fp8 import AmaxHistory, E4M3, E5M2, FP8Recipe, quantize, quantize_dequantize

T = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
ALL = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def test_tensorwise_e4m3_grid_points():
    # amax 3.5 -> scale 448 / 3.5 = 128 exactly; 0.3 * 128 = 38.4 -> nearest grid point 40
    out = quantize_dequantize(T(1.0, -2.0, 3.5, 0.3), FP8Recipe(granularity="tensorwise"))
    assert out.tolist() == [1.0, -2.0, 3.5, 40 / 128]


def test_tensorwise_hybrid_grad_is_e5m2():
    # amax 7 -> scale 57344 / 7 = 8192; 0.3 * 8192 = 2457.6 -> e5m2 step 512 in [2048, 4096)
    recipe = FP8Recipe(format="hybrid", granularity="tensorwise")
    x = T(1.0, 0.3, -7.0)
    assert quantize_dequantize(x, recipe, "grad").tolist() == [1.0, 2560 / 8192, -7.0]
    # the forward roles stay e4m3: amax 7 -> scale 64, 0.3 * 64 = 19.2 -> step 2 in [16, 32)
    assert quantize_dequantize(x, recipe, "activation").tolist() == [1.0, 20 / 64, -7.0]
    assert recipe.element_format("weight") is E4M3 and recipe.element_format("grad") is E5M2
    assert FP8Recipe(format="e4m3").element_format("grad") is E4M3


def test_round_to_nearest_even_ties():
    # amax 448 -> scale exactly 1, so the values below are rounded as they are.
    x = T(448.0, 1.0625, 1.1875, 232.0, 248.0, 2**-10, 3 * 2**-10)
    out = quantize_dequantize(x, FP8Recipe())
    # 1.0625 is halfway 1 | 1.125 -> even mantissa 000 -> 1; 1.1875: 1.125 | 1.25 -> 1.25;
    # 232: 224 | 240 -> 224; 248: 240 | 256 -> 256; 2**-10 halfway 0 | 2**-9 -> 0;
    # 3 * 2**-10 halfway 2**-9 | 2**-8 -> 2**-8
    assert out.tolist() == [448.0, 1.0, 1.25, 224.0, 256.0, 0.0, 2**-8]


def test_saturation_clamps_instead_of_inf():
    # A stale delayed scale makes x * scale exceed the format's max: it must saturate.
    e4 = AmaxHistory(E4M3, history_len=1, algo="most_recent", margin=0)
    e4.record(torch.tensor(3.5))  # next scale 448 / 3.5 = 128
    recipe = FP8Recipe(granularity="delayed", format="hybrid")
    out = quantize_dequantize(T(10.0, 0.5, -1000.0), recipe, "activation", state=e4)
    assert out.tolist() == [3.5, 0.5, -3.5]  # 1280 -> 448, 64 exact, -128000 -> -448
    e5 = AmaxHistory(E5M2, history_len=1, algo="most_recent", margin=0)
    e5.record(torch.tensor(7.0))  # next scale 57344 / 7 = 8192
    out = quantize_dequantize(T(10.0, -10.0, 0.5), recipe, "grad", state=e5)
    assert out.tolist() == [7.0, -7.0, 0.5]  # 81920 would overflow e5m2 to inf without clamp
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("granularity", ALL + ("delayed",))
@pytest.mark.parametrize("role", ["activation", "weight", "grad"])
def test_amax_zero_gives_zeros_not_nan(granularity, role):
    recipe = FP8Recipe(format="hybrid", granularity=granularity)
    state = AmaxHistory(recipe.element_format(role), 4, "max", 0) if granularity == "delayed" \
        else None
    x = torch.zeros(3, 300)
    out = quantize_dequantize(x, recipe, role, state=state)
    assert torch.equal(out, x)
    if state is not None:  # an all-zero tensor keeps the previous scale
        assert state.scale.item() == 1.0


def test_current_scale_not_a_power_of_two_matches_fp32_formula():
    # scale = fl32(448 / 0.6), scale_inv = fl32(1 / scale): computed here in numpy float32
    x = T(0.6, 0.3)
    scale = np.float32(448.0) / np.float32(0.6)
    scale_inv = np.float32(1.0) / scale
    q = [np.float32(v) * scale for v in (np.float32(0.6), np.float32(0.3))]
    assert [float(v) for v in q] == [448.0, 224.0]  # both exactly on the e4m3 grid
    expected = [float(np.float32(448.0) * scale_inv), float(np.float32(224.0) * scale_inv)]
    assert quantize_dequantize(x, FP8Recipe()).tolist() == expected


def test_power_of_two_scale_option():
    # fp32 scale 448 / 0.6 = 746.7 rounds down to 512: 0.6*512 = 307.2 -> 320; 0.3 -> 160
    recipe = FP8Recipe(granularity="tensorwise", power_of_two_scales=True)
    q = quantize(T(0.6, 0.3), recipe)
    assert q.scale.item() == 512.0
    assert q.dequantize().tolist() == [320 / 512, 160 / 512]
    assert FP8Recipe(granularity="blockwise").pow2_scales  # TE's blockwise default
    assert not FP8Recipe(granularity="blockwise", power_of_two_scales=False).pow2_scales
    assert not FP8Recipe(granularity="tensorwise").pow2_scales


def test_rowwise_scales_each_row_along_the_axis():
    x = torch.tensor([[3.5, 0.3], [0.6, 0.3]])
    out = quantize_dequantize(x, FP8Recipe(granularity="rowwise"))
    assert out[0].tolist() == [3.5, 40 / 128]  # row amax 3.5 -> scale 128 -> 38.4 -> 40
    assert out[1, 0].item() == pytest.approx(0.6, abs=1e-7)  # row amax 0.6: 0.3 -> 224 exact
    assert out[1, 1].item() == pytest.approx(0.3, abs=1e-7)
    # tensorwise shares the 3.5 scale: the second row's 0.3 is rounded to 0.3125 as well
    tw = quantize_dequantize(x, FP8Recipe(granularity="tensorwise"))
    assert tw[1, 1].item() == 40 / 128
    # along axis 0: column 1 = [0.3, 0.3] has amax 0.3, column 0 amax 3.5 (0.6*128 = 76.8 -> 80)
    col = quantize_dequantize(x, FP8Recipe(granularity="rowwise"), axis=0)
    assert col[:, 1].tolist() == pytest.approx([0.3, 0.3], abs=1e-7)
    assert col[1, 0].item() == 80 / 128


def test_blockwise_activation_tiles_not_divisible_by_128():
    # [2, 300]: tiles [0,128) [128,256) [256,300); fp32 scales so each tile's amax shows.
    recipe = FP8Recipe(granularity="blockwise", power_of_two_scales=False)
    x = torch.full((2, 300), 0.3)
    x[0, 0], x[0, 200], x[0, 299] = 0.6, 3.5, 0.6
    out = quantize_dequantize(x, recipe)
    assert torch.allclose(out[0, :128], x[0, :128], atol=1e-7)  # amax 0.6: 0.3 -> 224 exact
    assert out[0, 127].item() == pytest.approx(0.3, abs=1e-7)  # last column of tile 0
    assert (out[0, 128:256] == torch.where(x[0, 128:256] == 3.5, 3.5, 40 / 128)).all()
    assert torch.allclose(out[0, 256:], x[0, 256:], atol=1e-7)  # the partial tile
    assert torch.allclose(out[1], x[1], atol=1e-7)  # every tile amax 0.3
    # along axis 0 the tiles run over rows: column 200 = [3.5, 0.3] shares one tile
    col = quantize_dequantize(x, recipe, axis=0)
    assert col[1, 200].item() == 40 / 128 and col[1, 199].item() == pytest.approx(0.3, abs=1e-7)


def test_blockwise_weight_128x128_blocks_with_partial_edges():
    recipe = FP8Recipe(granularity="blockwise", power_of_two_scales=False)
    # blocks: rows [0,128) [128,200) x cols [0,128) [128,256) [256,300)
    w = torch.full((200, 300), 0.3)
    w[150, 280] = 3.5
    out = quantize_dequantize(w, recipe, "weight")
    assert out[150, 280].item() == 3.5
    assert out[128, 256].item() == 40 / 128 and out[199, 299].item() == 40 / 128  # same block
    assert out[127, 280].item() == pytest.approx(0.3, abs=1e-7)  # block above
    assert out[150, 255].item() == pytest.approx(0.3, abs=1e-7)  # block to the left
    changed = (out != w) & ((out - w).abs() > 1e-6)
    assert changed.sum().item() == 72 * 44 - 1  # exactly that block's 0.3 entries


def test_blockwise_default_power_of_two_scales():
    q = quantize(torch.full((1, 256), 0.3).index_fill_(1, torch.tensor([0]), 0.6),
                 FP8Recipe(granularity="blockwise"))
    scales = q.scale.flatten().tolist()
    assert scales == [512.0, 1024.0]  # 448/0.6 = 746.7 -> 512; 448/0.3 = 1493.3 -> 1024
    assert q.dequantize()[0, :2].tolist() == [320 / 512, 160 / 512]


def test_mxfp8_e8m0_scales():
    recipe = FP8Recipe(granularity="mxfp8")
    x = torch.zeros(1, 96)
    x[0, :32] = 0.3
    x[0, 0] = 1.0  # block 0: amax 1 -> 1/448 = 2**-8.8 -> rounded up 2**-8 -> scale_inv 2**-8
    x[0, 32:64] = 480.0  # block 1: 480/448 -> 2**1; 480/2 = 240 (OCP's floor rule saturates)
    x[0, 64] = 3.0  # block 2: 3/448 -> 2**-7; 3 * 128 = 384 exact; rest zeros
    q = quantize(x, recipe)
    scale_inv = q.scale_inv.flatten()
    assert scale_inv.tolist() == [2.0**-8, 2.0, 2.0**-7]
    assert torch.equal(scale_inv.to(torch.float8_e8m0fnu).float(), scale_inv)  # E8M0-exact
    out = q.dequantize()
    assert out[0, 0].item() == 1.0 and out[0, 1].item() == 80 / 256  # 76.8 -> 80
    assert (out[0, 32:64] == 480.0).all()
    assert out[0, 64].item() == 3.0 and (out[0, 65:] == 0).all()
    # E5M2 gradients: 3 / 57344 -> 2**-14.2 -> 2**-14; 3 * 2**14 = 49152 exact
    g = quantize(T(3.0, 1.0), FP8Recipe(format="hybrid", granularity="mxfp8"), "grad")
    assert g.scale_inv.flatten().tolist() == [2.0**-14]
    assert g.dequantize().tolist() == [3.0, 1.0]


def test_mxfp8_partial_block_and_axis0():
    x = torch.ones(40, 3)
    x[35, 1] = 448.0  # along axis 0, rows 32..39 are a partial block of column 1
    out = quantize_dequantize(x, FP8Recipe(granularity="mxfp8"), axis=0)
    assert out[35, 1].item() == 448.0 and out[0, 1].item() == 1.0
    assert torch.equal(out[:, 0], x[:, 0])


def test_delayed_scaling_uses_the_history_of_earlier_steps():
    recipe = FP8Recipe(granularity="delayed", amax_history_len=3, amax_compute_algo="max")
    state = AmaxHistory(E4M3, 3, "max", 0)
    out1 = quantize_dequantize(T(0.3, 2.0), recipe, state=state)
    assert out1.tolist() == [0.3125, 2.0]  # first step: scale 1 (TE's initial scale)
    assert state.scale.item() == 224.0  # 448 / 2
    out2 = quantize_dequantize(T(0.3, 1.0), recipe, state=state)
    inv = np.float32(1.0) / np.float32(224.0)  # fp32 scale_inv, as the kernel stores it
    # 0.3 * 224 = 67.2 -> 64 (step 8 in [64, 128)); 224 -> 224
    assert out2.tolist() == [float(np.float32(64) * inv), float(np.float32(224) * inv)]
    assert state.scale.item() == 224.0  # max over the window still 2.0
    recent = AmaxHistory(E4M3, 3, "most_recent", 1)
    for v in (2.0, 1.0):
        quantize_dequantize(T(v), recipe, state=recent)
    assert recent.scale.item() == 224.0  # (448 / 1.0) / 2**margin
    with pytest.raises(ValueError, match="state"):
        quantize_dequantize(T(1.0), recipe)


@pytest.mark.parametrize("granularity", ALL)
def test_shape_and_dtype_are_preserved(granularity):
    x = torch.randn(5, 7, 70, dtype=torch.bfloat16)
    out = quantize_dequantize(x, FP8Recipe(granularity=granularity))
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert (out.float() - x.float()).abs().max() <= 0.07 * x.float().abs().max()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32).map(
    lambda v: 0.0 if abs(v) < 1e-30 else v), min_size=1, max_size=300),
       st.sampled_from(ALL))
def test_relative_error_within_half_an_e4m3_step(values, granularity):
    # A value whose scaled magnitude is in e4m3's normal range is off by <= 2**-4 relative.
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    q = quantize(x, FP8Recipe(granularity=granularity))
    out = q.dequantize()
    scaled = (q.unblock(q.data.float()).abs())
    normal = scaled >= 2**-6
    err = (out - x).abs()
    assert torch.all(err[normal] <= x.abs()[normal] * (2**-4 + 1e-6))
    assert torch.isfinite(out).all()
    assert math.isclose(out.abs().max().item(), x.abs().max().item(), rel_tol=2**-4)
