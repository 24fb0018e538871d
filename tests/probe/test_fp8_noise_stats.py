"""The probe's pure parts: configuration, data, layouts and the statistics (no model)."""
import math

import pytest
import torch

from megatron_calibclip.probe import (ProbeConfig, ProbeError, bucket_stats, parse_recipes,
                                      ratio_stats)
from megatron_calibclip.probe.fp8_noise import BYTE_OFFSET, make_layouts, make_sequences


def test_parse_recipes():
    assert parse_recipes("all") == ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
    assert parse_recipes(["blockwise,tensorwise", "blockwise"]) == ("tensorwise", "blockwise")
    with pytest.raises(ProbeError, match=r"probe\.recipes: 'rowise' is not one of"):
        parse_recipes("rowise")


@pytest.mark.parametrize("kw, match", [
    (dict(model="gpt5"), r"probe\.model: 'gpt5' is not one of"),
    (dict(tokens="wiki"), r"probe\.tokens"),
    (dict(lrs=()), r"probe\.lrs"),
    (dict(lrs=(1e-6, -1.0)), r"probe\.lrs"),
    (dict(eps_low=1.2), r"probe\.eps_low"),
    (dict(micro_batch=0), r"probe\.micro_batch"),
    (dict(corrupt=1.0), r"probe\.corrupt"),
    (dict(neg_frac=0.0), r"probe\.neg_frac"),
])
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ProbeError, match=match):
        ProbeConfig(**kw)


def test_ratio_stats_phantom_counting():
    lo = math.log(0.8)
    # tokens:            0      1      2      3      4      5
    log_r8 = torch.tensor([-0.3, -0.3, -0.1, -0.3, 0.3, -0.3])
    log_r16 = torch.tensor([-0.1, -0.3, -0.1, -0.1, 0.0, 0.0])
    log_r32 = torch.tensor([-0.3, -0.1, -0.1, -0.1, 0.0, 0.0])
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0, 1.0])
    s = ratio_stats(log_r8, log_r16, log_r32, adv, eps_low=0.2, eps_high=0.28)
    assert log_r8[0] < lo < log_r8[2]
    assert s["clip_low_rate_neg"] == 3 / 4  # tokens 0, 1, 3 (token 5 has A > 0)
    assert s["phantom_vs_bf16"] == 2 / 4  # 0 and 3: clipped in FP8, not in BF16
    assert s["phantom_vs_fp32"] == 2 / 4  # 1 and 3
    assert s["clip_high_rate_pos"] == 1 / 2  # token 4: exp(0.3) = 1.35 > 1.28
    assert s["noise_std_vs_fp32"] == pytest.approx((log_r8 - log_r32).double().std(
        unbiased=False).item())
    assert s["ratio_ne_1_frac"] == 1.0


def test_bucket_stats():
    p = torch.tensor([0.001, 0.005, 0.05, 0.2, 0.9, 1.0])
    v = torch.tensor([1.0, 3.0, 5.0, 7.0, 9.0, 11.0])
    b = bucket_stats(p, v)
    assert b["count"] == [2, 1, 1, 2]
    assert b["mean"] == [2.0, 5.0, 7.0, 10.0]
    assert b["all_mean"] == 6.0
    assert bucket_stats(torch.tensor([0.9]), torch.tensor([1.0]))["mean"][:3] == [None] * 3


def test_layouts_cover_every_sequence_once():
    a, b = make_layouts(10, 4, 3, seed=0)
    assert [len(m) for m in a] == [4, 4, 2] and a[0] == [0, 1, 2, 3]
    assert [len(m) for m in b] == [3, 3, 3, 1]
    assert sorted(i for m in b for i in m) == list(range(10))
    assert [i for m in b for i in m] != list(range(10))  # shuffled: other neighbours


def test_byte_tokens_and_corruption():
    cfg = ProbeConfig(max_len=40)
    clean = make_sequences(cfg, 6, seed=0, vocab_size=1000)
    assert all(s[0] == 1 and len(s) <= 40 for s in clean)
    assert all(int(s[1:].min()) >= BYTE_OFFSET and int(s.max()) < BYTE_OFFSET + 128
               for s in clean)  # ASCII text
    dirty = make_sequences(cfg, 6, seed=0, vocab_size=1000, corrupt=0.3)
    changed = sum(int((c != d).sum()) for c, d in zip(clean, dirty))
    total = sum(len(s) - 1 for s in clean)
    assert 0.15 * total < changed < 0.45 * total
    assert all(c[0] == d[0] for c, d in zip(clean, dirty))
    with pytest.raises(ProbeError, match="byte tokens need a vocabulary"):
        make_sequences(cfg, 2, seed=0, vocab_size=200)
    rnd = make_sequences(ProbeConfig(tokens="random", max_len=40), 5, seed=1, vocab_size=50)
    assert all(20 <= len(s) <= 40 and int(s.max()) < 50 for s in rnd)


class _Linear(torch.nn.Module):
    """Stands in for an emulated linear: emulated_linears() finds it by its marker."""

    _calibclip_emulated = True

    def __init__(self, w):
        super().__init__()
        self.weight = torch.nn.Parameter(w)


def test_rounding_ties_and_dither():
    from megatron_calibclip.fp8.formats import round_to_bf16
    from megatron_calibclip.probe.fp8_noise import dither_weights, rounding_tie_fractions

    g = torch.Generator().manual_seed(0)
    w = round_to_bf16(torch.randn(256, 384, generator=g) * 0.05)  # a bf16 checkpoint
    bits = w.view(torch.int32)
    bits[:8] |= 0x8000  # 8 rows of exact bf16 ties (low 16 bits 0x8000)
    w[8, :5] = 0.0
    model = torch.nn.Sequential(_Linear(w.clone()))
    before = rounding_tie_fractions(model, ("tensorwise", "delayed", "blockwise", "mxfp8"))
    assert before["bf16"] == pytest.approx(8 / 256)
    assert before["delayed"] is None
    # power-of-two scales: a bf16 value whose 4 mantissa bits below E4M3's are 1000 is a tie
    assert 0.05 < before["blockwise"] < 0.07 and 0.05 < before["mxfp8"] < 0.07
    assert before["tensorwise"] < 1e-3  # an fp32 scale 448/amax puts almost nothing on a tie
    moved = dither_weights(model, seed=1)
    new = model[0].weight.detach()
    after = rounding_tie_fractions(model, ("tensorwise", "blockwise", "mxfp8"))
    assert after == {"bf16": 0.0, "tensorwise": 0.0, "blockwise": 0.0, "mxfp8": 0.0}
    assert moved == w.numel() - 5  # every weight was bf16-exact or a tie, except the zeros
    keep = torch.ones_like(w, dtype=torch.bool)
    keep[:8] = False
    assert torch.equal(round_to_bf16(new)[keep], w[keep])  # same bf16 values
    assert ((new - w).abs() <= w.abs() * 2.0 ** -8).all()  # below half a bf16 step
    assert (new[8, :5] == 0).all()
    ties_bf16 = round_to_bf16(new[:8])
    step = w[:8].abs() * 2**-10
    lo, hi = round_to_bf16(w[:8] - step), round_to_bf16(w[:8] + step)
    assert ((ties_bf16 == lo) | (ties_bf16 == hi)).all()
    assert 0.3 < (ties_bf16 == hi).float().mean() < 0.7  # a random side
