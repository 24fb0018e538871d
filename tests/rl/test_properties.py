"""Hypothesis properties: gradient zero-pattern, shard/padding/permutation invariances,
exact counts merging, advantage invariances, overlong monotonicity, verifier round trips."""
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_calibclip.rl import (
    finalize_metrics,
    grpo_advantages,
    merge_counts,
    merge_extrema,
    mis_weights,
    overlong_penalty,
    policy_loss,
    tis_weights,
    verify_math_answer,
)

D = torch.float64
FAST = settings(max_examples=30, deadline=None)
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@st.composite
def batches(draw, min_b=1, max_b=4, max_t=6):
    b = draw(st.integers(min_b, max_b))
    t = draw(st.integers(1, max_t))
    fl = st.floats(-1.5, 1.5, allow_nan=False, allow_infinity=False)
    lp = draw(st.lists(fl, min_size=b * t, max_size=b * t))
    old = draw(st.lists(fl, min_size=b * t, max_size=b * t))
    adv = draw(st.lists(st.floats(-3, 3, allow_nan=False), min_size=b, max_size=b))
    mask = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    m = torch.tensor(mask).reshape(b, t)
    m[:, 0] = True  # every sequence has a token, so every shard is valid
    return (torch.tensor(lp, dtype=D).reshape(b, t), torch.tensor(old, dtype=D).reshape(b, t),
            torch.tensor(adv, dtype=D), m)


bounds = st.tuples(st.floats(0.3, 0.99), st.floats(1.01, 3.0))


@FAST
@given(batches(), bounds, st.booleans())
def test_gradient_zero_exactly_where_clipped(batch, lh, dual):
    lp, old, adv, mask = batch
    L, H = lh
    c = 3.0
    lp = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, clip_low=L, clip_high=H, dual_clip=dual, dual_clip_c=c)
    loss.backward()
    r = torch.exp(lp.detach() - old)
    a = adv[:, None].expand_as(r)
    n = mask.sum().item()
    zero = ((a < 0) & (r < L)) | ((a > 0) & (r > H)) | ~mask
    if dual:
        zero |= (a < 0) & (r > c) & mask
    assert (lp.grad[zero] == 0).all()
    expected = -a * r / n
    assert torch.allclose(lp.grad[~zero], expected[~zero], rtol=1e-10, atol=1e-15)


@FAST
@given(batches(min_b=2), bounds, st.sampled_from(MODES), st.data())
def test_micro_batch_split_is_exact(batch, lh, mode, data):
    lp, old, adv, mask = batch
    split = data.draw(st.integers(1, lp.shape[0] - 1))
    kw = dict(clip_low=lh[0], clip_high=lh[1], loss_agg_mode=mode, correction="tis", shadow_eps_low=0.2)
    roll, shadow = old * 0.9, (lp - old) * 0.5

    def run(s, **norm):
        return policy_loss(lp[s], old[s], adv[s], mask[s], rollout_logprobs=roll[s], shadow_log_ratio=shadow[s],
                           **kw, **norm)

    full, mf = run(slice(None))
    if mode == "token-mean":
        norm = dict(num_tokens=mask.sum())
    else:
        norm = dict(num_sequences=lp.shape[0])
    if mode == "seq-mean-token-sum-norm":
        norm["max_response_length"] = lp.shape[1]
    parts = [run(s, **norm) for s in (slice(0, split), slice(split, None))]
    assert sum(p[0] for p in parts).item() == pytest.approx(full.item(), rel=1e-9, abs=1e-12)
    merged = finalize_metrics(merge_counts([p[1]["counts"] for p in parts]),
                              merge_extrema([p[1]["extrema"] for p in parts]))
    assert set(merged) == set(k for k in mf if k not in ("counts", "extrema", "loss"))
    for k, v in merged.items():
        assert v.item() == pytest.approx(mf[k].item(), rel=1e-9, abs=1e-12), k


@FAST
@given(batches(), bounds, st.sampled_from(MODES), st.integers(1, 3))
def test_padding_columns_change_nothing(batch, lh, mode, extra):
    lp, old, adv, mask = batch
    b, t = lp.shape
    pad = torch.full((b, extra), float("nan"), dtype=D)
    kw = dict(clip_low=lh[0], clip_high=lh[1], loss_agg_mode=mode)
    if mode == "seq-mean-token-sum-norm":
        kw["max_response_length"] = t + 3  # a fixed budget makes it padding-independent
    a, _ = policy_loss(lp, old, adv, mask, **kw)
    b_, _ = policy_loss(torch.cat([lp, pad], 1), torch.cat([old, pad], 1), adv,
                        torch.cat([mask, torch.zeros(b, extra, dtype=torch.bool)], 1), **kw)
    assert b_.item() == pytest.approx(a.item(), rel=1e-12, abs=1e-15)


@FAST
@given(batches(min_b=2), bounds, st.sampled_from(MODES), st.randoms(use_true_random=False))
def test_sequence_order_does_not_matter(batch, lh, mode, rnd):
    lp, old, adv, mask = batch
    perm = list(range(lp.shape[0]))
    rnd.shuffle(perm)
    kw = dict(clip_low=lh[0], clip_high=lh[1], loss_agg_mode=mode)
    a, _ = policy_loss(lp, old, adv, mask, **kw)
    b, _ = policy_loss(lp[perm], old[perm], adv[perm], mask[perm], **kw)
    assert b.item() == pytest.approx(a.item(), rel=1e-12, abs=1e-15)


@FAST
@given(st.lists(st.floats(-5, 5), min_size=4, max_size=32), st.floats(0.1, 3.0))
def test_importance_weights_never_exceed_cap(log_w, cap):
    lw = torch.tensor(log_w, dtype=D)
    mask = torch.ones_like(lw, dtype=torch.bool)
    w, capped = tis_weights(lw, mask, cap=cap)
    assert (w <= cap).all() and (w > 0).all()
    assert torch.equal(capped, torch.exp(lw) > cap)
    for level in ("token", "sequence"):
        wm, rejected = mis_weights(lw[None], mask[None], cap=cap, level=level)
        assert (wm <= cap).all()
        assert (wm[rejected] == 0).all()
        kept = mask[None] & ~rejected
        assert (wm[kept] > 0).all()


group_rewards = st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0]), min_size=2, max_size=6),
                         min_size=1, max_size=4).filter(lambda g: len({len(x) for x in g}) == 1)


@FAST
@given(group_rewards, st.floats(0.1, 10.0), st.floats(-5.0, 5.0))
def test_grpo_advantage_invariances(groups, scale, shift):
    r = torch.tensor(groups, dtype=D)
    adv = grpo_advantages(r, eps=0.0)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(r.shape[0], dtype=D), atol=1e-9)
    moved = grpo_advantages(r * scale + shift, eps=0.0)
    assert torch.allclose(moved, adv, atol=1e-8)
    flat = r.amax(1) == r.amin(1)
    assert (adv[flat] == 0).all()


@FAST
@given(st.integers(1, 64), st.data())
def test_overlong_monotone_and_bounded(max_len, data):
    cache = data.draw(st.integers(1, max_len))
    n = torch.arange(0, max_len + 5)
    p = overlong_penalty(n, max_length=max_len, cache_length=cache)
    assert ((p <= 0) & (p >= -1)).all()
    assert (p[1:] <= p[:-1]).all()
    assert p[max_len - cache].item() == 0.0 and p[max_len].item() == -1.0


@FAST
@given(st.integers(-10**9, 10**9), st.integers(1, 10**4), st.integers(-10**4, 10**4))
def test_verifier_round_trips(n, q, p):
    assert verify_math_answer(f"\\boxed{{{n:,}}}", str(n))
    assert not verify_math_answer(f"\\boxed{{{n + 1}}}", str(n))
    frac = Fraction(p, q)
    assert verify_math_answer(f"\\boxed{{\\frac{{{p}}}{{{q}}}}}", f"{float(frac):.12g}")
    assert verify_math_answer(f"#### {frac.numerator}/{frac.denominator}", f"{p}/{q}")
    assert math.isfinite(float(frac))
