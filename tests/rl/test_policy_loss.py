"""Hand-derived cases for rl.policy_loss: clip semantics, dual-clip, TIS/MIS, KL, metrics."""
import math

import pytest
import torch

from megatron_calibclip.rl import finalize_metrics, merge_counts, merge_extrema, policy_loss, ppo_clip_bounds

D = torch.float64


def _lp(ratios):
    """log-probs whose ratio to old = 0 is exactly `ratios` (up to exp/log rounding)."""
    return torch.tensor([math.log(r) for r in ratios], dtype=D)


def _run(ratios, adv, **kw):
    lp = _lp(ratios).requires_grad_(True)
    old = torch.zeros_like(lp)
    mask = torch.ones_like(lp, dtype=torch.bool)
    loss, metrics = policy_loss(lp, old, torch.tensor(adv, dtype=D), mask, **kw)
    loss.backward()
    return loss, lp.grad, metrics


# L = 0.8, H = 1.28 (DAPO bounds). Per token: (r, A, clipped?, loss_t = -A * r_eff)
CASES = [
    (0.5, -1.0, True, 0.8),  # A<0, r<L: clipped, loss -A*L
    (1.0, -1.0, False, 1.0),  # inside
    (2.0, -1.0, False, 2.0),  # A<0, r>H: NOT clipped (min picks r*A)
    (1.5, 2.0, True, -2.0 * 1.28),  # A>0, r>H: clipped, loss -A*H
    (0.5, 2.0, False, -1.0),  # A>0, r<L: NOT clipped
    (1.0, 2.0, False, -2.0),
]


def test_clip_gradient_zero_exactly_where_clipped():
    ratios = [c[0] for c in CASES]
    adv = [c[1] for c in CASES]
    loss, grad, metrics = _run(ratios, adv, clip_low=0.8, clip_high=1.28)
    n = len(CASES)
    assert loss.item() == pytest.approx(sum(c[3] for c in CASES) / n, rel=1e-12)
    for i, (r, a, clipped, _) in enumerate(CASES):
        if clipped:
            assert grad[i].item() == 0.0
        else:  # d(-A r)/dlogp = -A r, divided by the token count
            assert grad[i].item() == pytest.approx(-a * r / n, rel=1e-12)
    # diagnostics: 3 negative tokens, 1 clipped below; 3 positive tokens, 1 clipped above
    assert metrics["clipfrac_lower"].item() == pytest.approx(1 / 3)
    assert metrics["clipfrac_upper"].item() == pytest.approx(1 / 3)
    assert metrics["clipfrac"].item() == pytest.approx(2 / 6)
    assert metrics["ratio_mean"].item() == pytest.approx(sum(ratios) / n)
    assert metrics["ratio_min"].item() == pytest.approx(0.5)
    assert metrics["ratio_max"].item() == pytest.approx(2.0)
    assert metrics["counts"]["neg_tokens"].item() == 3
    assert metrics["counts"]["pos_tokens"].item() == 3


def test_matches_min_formulation_and_tensor_bounds():
    """Same value as the textbook -min(rA, clip(r, L, H)A), with bounds given as 0-d tensors."""
    torch.manual_seed(0)
    lp = torch.randn(3, 7, dtype=D) * 0.5
    old = torch.randn(3, 7, dtype=D) * 0.5
    adv = torch.randn(3, dtype=D)
    mask = torch.rand(3, 7) > 0.2
    L, H = torch.tensor(0.7, dtype=D), torch.tensor(1.5, dtype=D)
    loss, _ = policy_loss(lp, old, adv, mask, clip_low=L, clip_high=H)
    r = torch.exp(lp - old)
    a = adv[:, None].expand_as(r)
    per_tok = -torch.minimum(r * a, torch.clamp(r, 0.7, 1.5) * a)
    expected = per_tok[mask].sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


def test_bounds_given_as_floats_and_tensors_agree():
    lp, old = _lp([0.5, 1.4]), torch.zeros(2, dtype=D)
    adv, mask = torch.tensor([-1.0, 1.0], dtype=D), torch.ones(2, dtype=torch.bool)
    a, _ = policy_loss(lp, old, adv, mask, clip_low=0.6, clip_high=1.8)
    b, _ = policy_loss(lp, old, adv, mask, clip_low=torch.tensor(0.6), clip_high=torch.tensor(1.8))
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    # [0.6, 1.8]: r=0.5 with A<0 clipped -> 0.6; r=1.4 with A>0 inside -> -1.4
    assert a.item() == pytest.approx((0.6 - 1.4) / 2)


def test_dual_clip_caps_negative_advantage_loss():
    # L, H = 0.8, 1.2; c = 3
    ratios = [5.0, 10.0, 2.0, 5.0]
    adv = [-1.0, -2.0, -1.0, 1.0]
    loss, grad, metrics = _run(ratios, adv, clip_low=0.8, clip_high=1.2, dual_clip=True, dual_clip_c=3.0)
    # token losses: min(-A r, -c A): 3*1, 3*2, 2 (r<c, untouched), A>0 r>H -> -1.2
    assert loss.item() == pytest.approx((3.0 + 6.0 + 2.0 - 1.2) / 4, rel=1e-12)
    assert grad[0].item() == 0.0 and grad[1].item() == 0.0 and grad[3].item() == 0.0
    assert grad[2].item() == pytest.approx(1.0 * 2.0 / 4, rel=1e-12)
    assert metrics["dual_clipfrac"].item() == pytest.approx(2 / 3)
    # without dual-clip the same tokens are unbounded
    loss_plain, _, _ = _run(ratios, adv, clip_low=0.8, clip_high=1.2)
    assert loss_plain.item() == pytest.approx((5.0 + 20.0 + 2.0 - 1.2) / 4, rel=1e-12)


def test_per_sequence_advantages_broadcast():
    lp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0], dtype=D)
    loss, _ = policy_loss(lp, lp.detach(), adv, mask, clip_low=0.8, clip_high=1.2)
    loss.backward()
    # r = 1 everywhere: token loss -A; token-mean over 6 tokens
    assert loss.item() == pytest.approx((3 * -1.0 + 3 * 2.0) / 6)
    assert torch.allclose(lp.grad, torch.tensor([[-1.0] * 3, [2.0] * 3], dtype=D) / 6)


def test_tis_weight_is_capped_and_detached():
    lp = torch.zeros(2, dtype=D, requires_grad=True)
    old = torch.zeros(2, dtype=D)
    rollout = torch.tensor([-math.log(3.0), -math.log(1.5)], dtype=D)  # w = pi_old/mu = 3, 1.5
    adv, mask = torch.ones(2, dtype=D), torch.ones(2, dtype=torch.bool)
    loss, m = policy_loss(lp, old, adv, mask, clip_low=0.8, clip_high=1.2,
                          rollout_logprobs=rollout, correction="tis", correction_cap=2.0)
    loss.backward()
    # weights min(3, 2) = 2 and 1.5; r = 1, A = 1
    assert loss.item() == pytest.approx(-(2.0 + 1.5) / 2)
    assert lp.grad.tolist() == pytest.approx([-2.0 / 2, -1.5 / 2])
    assert m["tis_clipfrac"].item() == pytest.approx(0.5)
    assert m["is_weight_mean"].item() == pytest.approx(1.75)
    assert m["mult_prob_error"].item() == pytest.approx((3.0 + 1.5) / 2)


def test_mis_token_masks_tokens_above_cap_but_keeps_normaliser():
    lp = torch.zeros(3, dtype=D, requires_grad=True)
    rollout = torch.tensor([-math.log(3.0), -math.log(1.5), math.log(2.0)], dtype=D)  # w = 3, 1.5, 0.5
    adv, mask = torch.ones(3, dtype=D), torch.ones(3, dtype=torch.bool)
    loss, m = policy_loss(lp, torch.zeros(3, dtype=D), adv, mask, clip_low=0.8, clip_high=1.2,
                          rollout_logprobs=rollout, correction="mis-token", correction_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.0 + 1.5 + 0.5) / 3)
    assert lp.grad[0].item() == 0.0
    assert m["mis_maskfrac"].item() == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "seq_weight, kept_w",
    [("product", [0.0, 0.0, 1.8, 1.8]),  # seq 0: 1.5 * 1.5 = 2.25 > 2 dropped; seq 1: 1.5 * 1.2 = 1.8
     ("geometric", [1.5, 1.5, math.sqrt(1.8), math.sqrt(1.8)])],  # both geometric means <= 2
)
def test_mis_sequence_level(seq_weight, kept_w):
    lw = torch.tensor([[math.log(1.5), math.log(1.5)], [math.log(1.5), math.log(1.2)]], dtype=D)
    lp = torch.zeros(2, 2, dtype=D, requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, m = policy_loss(lp, torch.zeros(2, 2, dtype=D), torch.ones(2, dtype=D), mask,
                          clip_low=0.8, clip_high=1.2, rollout_logprobs=-lw, correction="mis-seq",
                          correction_cap=2.0, mis_seq_weight=seq_weight)
    loss.backward()
    assert loss.item() == pytest.approx(-sum(kept_w) / 4)
    assert lp.grad.flatten().tolist() == pytest.approx([-w / 4 for w in kept_w])
    dropped = sum(1 for w in kept_w[::2] if w == 0.0)
    assert m["mis_seq_maskfrac"].item() == pytest.approx(dropped / 2)


def test_kl_penalty_and_entropy_bonus_in_loss():
    lp = torch.tensor([0.5, -0.5], dtype=D, requires_grad=True)
    old = lp.detach().clone()  # r = 1
    ref = torch.zeros(2, dtype=D)
    ent = torch.tensor([1.0, 3.0], dtype=D, requires_grad=True)
    adv, mask = torch.zeros(2, dtype=D), torch.ones(2, dtype=torch.bool)
    loss, m = policy_loss(lp, old, adv, mask, clip_low=0.8, clip_high=1.2, ref_logprobs=ref,
                          kl_coef=0.1, kl_type="k2", entropy=ent, entropy_coef=0.01)
    loss.backward()
    # k2 = d^2/2 = 0.125 per token; entropy mean 2
    assert loss.item() == pytest.approx(0.1 * 0.125 - 0.01 * 2.0)
    assert lp.grad.tolist() == pytest.approx([0.1 * 0.5 / 2, 0.1 * -0.5 / 2])
    assert ent.grad.tolist() == pytest.approx([-0.01 / 2, -0.01 / 2])
    assert m["kl_mean"].item() == pytest.approx(0.125)
    assert m["entropy_mean"].item() == pytest.approx(2.0)


def test_ref_logprobs_without_coef_only_logs():
    lp = torch.tensor([0.5], dtype=D)
    base, _ = policy_loss(lp, lp, torch.ones(1, dtype=D), torch.ones(1, dtype=torch.bool), clip_low=0.8, clip_high=1.2)
    loss, m = policy_loss(lp, lp, torch.ones(1, dtype=D), torch.ones(1, dtype=torch.bool), clip_low=0.8,
                          clip_high=1.2, ref_logprobs=torch.zeros(1, dtype=D), kl_type="k1")
    assert loss.item() == base.item()
    assert m["kl_mean"].item() == pytest.approx(0.5)


def test_phantom_clip_fraction():
    # A<0 tokens: (r8, r16) = (0.5, 0.9) phantom; (0.5, 0.7) clipped by both; (1.0, 1.0) none.
    # A>0 token (0.5, 1.0) must not count. eps_low = 0.2 -> BF16 lower bound 0.8; L = 0.8.
    r8 = [0.5, 0.5, 1.0, 0.5]
    r16 = torch.tensor([math.log(x) for x in [0.9, 0.7, 1.0, 1.0]], dtype=D)
    _, _, m = _run(r8, [-1.0, -1.0, -1.0, 1.0], clip_low=0.8, clip_high=1.28,
                   shadow_log_ratio=r16, shadow_eps_low=0.2, shadow_eps_high=0.28)
    assert m["phantom_clipfrac"].item() == pytest.approx(1 / 3)
    assert m["shadow_clipfrac_lower"].item() == pytest.approx(1 / 3)
    assert m["clipfrac_lower"].item() == pytest.approx(2 / 3)
    assert m["shadow_clipfrac_upper"].item() == 0.0
    # with a calibrated (lower) L = 0.4, nothing is clipped, so nothing is phantom
    _, _, m2 = _run(r8, [-1.0, -1.0, -1.0, 1.0], clip_low=0.4, clip_high=1.8,
                    shadow_log_ratio=r16, shadow_eps_low=0.2)
    assert m2["phantom_clipfrac"].item() == 0.0


def test_padding_nan_does_not_leak():
    lp = torch.tensor([[0.1, float("nan")], [0.2, 0.3]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.0, float("inf")], [0.0, float("nan")]], dtype=D)
    adv = torch.tensor([[1.0, float("nan")], [-1.0, float("nan")]], dtype=D)
    mask = torch.tensor([[True, False], [True, False]])
    loss, m = policy_loss(lp, old, adv, mask, clip_low=0.8, clip_high=1.28)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[1, 1].item() == 0.0
    assert loss.item() == pytest.approx((-math.exp(0.1) + math.exp(0.2)) / 2)
    assert all(torch.isfinite(v) for k, v in m.items() if isinstance(v, torch.Tensor))


def test_global_normaliser_and_counts_merge_exactly():
    torch.manual_seed(1)
    B, T = 4, 6
    lp = (torch.randn(B, T, dtype=D) * 0.3).requires_grad_(True)
    old = torch.randn(B, T, dtype=D) * 0.3
    adv = torch.randn(B, dtype=D)
    mask = torch.rand(B, T) > 0.3
    mask[:, 0] = True
    kw = dict(clip_low=0.8, clip_high=1.28)
    full, mf = policy_loss(lp, old, adv, mask, **kw)
    n_tok = mask.sum()
    parts, counts, extrema = [], [], []
    for sl in (slice(0, 1), slice(1, 4)):  # uneven micro-batches
        loss, m = policy_loss(lp[sl], old[sl], adv[sl], mask[sl], num_tokens=n_tok, **kw)
        parts.append(loss)
        counts.append(m["counts"])
        extrema.append(m["extrema"])
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)
    merged = finalize_metrics(merge_counts(counts), merge_extrema(extrema))
    for k in ("clipfrac_lower", "clipfrac_upper", "ratio_mean", "ratio_min", "ratio_max"):
        assert merged[k].item() == pytest.approx(mf[k].item(), rel=1e-12)


def test_ppo_clip_bounds():
    assert ppo_clip_bounds(0.2, 0.28) == pytest.approx((0.8, 1.28))


# ---- bad input -------------------------------------------------------------------------
def _good():
    return dict(
        logprobs=torch.zeros(2, 3), old_logprobs=torch.zeros(2, 3), advantages=torch.ones(2),
        mask=torch.ones(2, 3, dtype=torch.bool),
    )


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(old_logprobs=torch.zeros(2, 4)), "old_logprobs"),
        (dict(advantages=torch.ones(3)), "advantages"),
        (dict(advantages=torch.ones(2, 4)), "advantages"),
        (dict(mask=torch.ones(3, 3, dtype=torch.bool)), "mask"),
        (dict(mask=torch.ones(2, 3)), "mask"),  # not bool
        (dict(mask=torch.zeros(2, 3, dtype=torch.bool)), "mask"),  # empty
        (dict(logprobs=torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]])), "logprobs"),
        (dict(old_logprobs=torch.tensor([[0.0, 0.0, 0.0], [0.0, float("-inf"), 0.0]])), "old_logprobs"),
        (dict(advantages=torch.tensor([float("nan"), 1.0])), "advantages"),
        (dict(logprobs=torch.zeros(2, 3, 4)), "logprobs"),
        (dict(clip_low=1.2, clip_high=0.8), "clip_low"),
        (dict(clip_low=0.8, clip_high=0.8), "clip_low"),
        (dict(clip_low=-0.1), "clip_low"),
        (dict(clip_low=torch.tensor([0.8])), "clip_low"),
        (dict(clip_high=float("nan")), "clip_high"),
        (dict(loss_agg_mode="mean"), "loss_agg_mode"),
        (dict(correction="tis"), "rollout_logprobs"),
        (dict(correction="icepop", rollout_logprobs=torch.zeros(2, 3)), "correction"),
        (dict(kl_coef=0.1), "ref_logprobs"),
        (dict(kl_type="k4", ref_logprobs=torch.zeros(2, 3)), "kl_type"),
        (dict(entropy_coef=0.1), "entropy"),
        (dict(shadow_log_ratio=torch.zeros(2, 3)), "shadow_eps_low"),
        (dict(shadow_log_ratio=torch.zeros(2, 3), shadow_eps_low=0.8 + 0.5), "shadow_eps_low"),
        (dict(shadow_log_ratio=torch.zeros(3, 3), shadow_eps_low=0.2), "shadow_log_ratio"),
        (dict(rollout_logprobs=torch.zeros(2, 2)), "rollout_logprobs"),
        (dict(dual_clip=True, dual_clip_c=0.9), "dual_clip_c"),
        (dict(num_tokens=3), "num_tokens"),  # fewer than the 6 local tokens
        (dict(num_sequences=2), "num_sequences"),  # wrong normaliser for token-mean
    ],
)
def test_bad_input_raises_value_error_naming_argument(change, name):
    kw = dict(_good(), clip_low=0.8, clip_high=1.28)
    kw.update(change)
    with pytest.raises(ValueError, match=name):
        policy_loss(kw.pop("logprobs"), kw.pop("old_logprobs"), kw.pop("advantages"), kw.pop("mask"), **kw)


def test_nan_at_masked_position_is_fine_but_unmasked_is_not():
    kw = _good()
    kw["logprobs"] = torch.tensor([[0.0, 0.0, float("nan")], [0.0, 0.0, 0.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss(kw["logprobs"], kw["old_logprobs"], kw["advantages"], mask, clip_low=0.8, clip_high=1.28)
    mask[0, 2] = False
    loss, _ = policy_loss(kw["logprobs"], kw["old_logprobs"], kw["advantages"], mask, clip_low=0.8, clip_high=1.28)
    assert torch.isfinite(loss)
