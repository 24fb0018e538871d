"""The correction registry and its newest entry, mis-token-two-sided (icepop-style), by hand."""
import math

import pytest
import torch

from megatron_calibclip.config import ConfigError, from_dict
from megatron_calibclip.rl import (
    CORRECTIONS,
    LossConfig,
    LossInputs,
    PolicyLossConfig,
    policy_loss,
    register_correction,
)

D = torch.float64


def test_two_sided_masks_both_tails_by_hand():
    # w = pi_old / mu = 3, 1.5, 0.4, 0.6, 1 with band [C_low, C] = [0.5, 2]:
    # 3 > 2 and 0.4 < 0.5 are masked (weight 0); the others keep their raw w (not capped).
    w = [3.0, 1.5, 0.4, 0.6, 1.0]
    lp = torch.zeros(5, dtype=D, requires_grad=True)
    rollout = torch.tensor([-math.log(x) for x in w], dtype=D)
    cfg = LossConfig(correction="mis-token-two-sided", correction_cap=2.0, correction_cap_low=0.5)
    inputs = LossInputs(lp, torch.zeros(5, dtype=D), torch.ones(5, dtype=D), torch.ones(5, dtype=torch.bool),
                        rollout_logprobs=rollout)
    loss, m = policy_loss(inputs, config=cfg, clip_low=0.8, clip_high=1.2)
    loss.backward()
    # r = 1, A = 1: token loss -w_kept; token-mean over all 5 tokens (masked ones stay in it)
    kept = [0.0, 1.5, 0.0, 0.6, 1.0]
    assert loss.item() == pytest.approx(-sum(kept) / 5, rel=1e-12)
    assert lp.grad.tolist() == pytest.approx([-k / 5 for k in kept], rel=1e-12)
    assert lp.grad[0].item() == 0.0 and lp.grad[2].item() == 0.0
    assert m["mis_maskfrac"].item() == pytest.approx(2 / 5)
    assert m["mis_maskfrac_low"].item() == pytest.approx(1 / 5)
    assert m["is_weight_mean"].item() == pytest.approx(sum(kept) / 5)
    assert m["mult_prob_error"].item() == pytest.approx((3.0 + 1.5 + 2.5 + 1 / 0.6 + 1.0) / 5)
    assert m["counts"]["mis_rejected_tokens"].item() == 2


def test_two_sided_composes_with_clipping_and_padding():
    # 2 sequences x 3 tokens, last token of row 1 is padding (NaN there must not leak).
    # row 0: A = -1, ratios 0.5 (clipped at L = 0.8), 1.0, 1.0;  w = 1.0, 0.25 (masked), 1.5
    # row 1: A = +2, ratios 1.0, 1.5 (clipped at H = 1.2);        w = 0.8, 1.0
    nan = float("nan")
    lp = torch.tensor([[math.log(0.5), 0.0, 0.0], [0.0, math.log(1.5), nan]], dtype=D, requires_grad=True)
    old = torch.zeros(2, 3, dtype=D)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w = torch.tensor([[1.0, 0.25, 1.5], [0.8, 1.0, 1.0]], dtype=D)
    rollout = torch.where(mask, -torch.log(w), torch.full_like(w, nan))
    inputs = LossInputs(lp, old, torch.tensor([-1.0, 2.0], dtype=D), mask, rollout_logprobs=rollout)
    cfg = LossConfig(correction="mis-token-two-sided", correction_cap=2.0, correction_cap_low=0.5,
                     loss_agg_mode="seq-mean-token-mean")
    loss, m = policy_loss(inputs, config=cfg, clip_low=0.8, clip_high=1.2)
    loss.backward()
    # token losses w * (-A r_eff): row 0: 1*0.8, 0, 1.5*1.0; row 1: 0.8*(-2*1.0), 1.0*(-2*1.2)
    row0 = (0.8 + 0.0 + 1.5) / 3
    row1 = (-1.6 - 2.4) / 2
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-12)
    # gradients: clipped tokens and the masked token get exactly 0; else -A r w / n_i / N_seq
    expected = [[0.0, 0.0, 1.0 * 1.0 * 1.5 / 3 / 2], [-2.0 * 1.0 * 0.8 / 2 / 2, 0.0, 0.0]]
    assert lp.grad.tolist() == [pytest.approx(row, rel=1e-12, abs=0.0) for row in expected]
    assert m["mis_maskfrac"].item() == pytest.approx(1 / 5)
    assert m["clipfrac_lower"].item() == pytest.approx(1 / 3)


def test_two_sided_with_open_lower_tail_equals_mis_token():
    torch.manual_seed(3)
    lp, old = torch.randn(3, 5, dtype=D) * 0.2, torch.randn(3, 5, dtype=D) * 0.2
    rollout = old + torch.randn(3, 5, dtype=D) * 0.8
    args = (lp, old, torch.randn(3, dtype=D), torch.rand(3, 5) > 0.2)
    a, ma = policy_loss(*args, clip_low=0.8, clip_high=1.2, rollout_logprobs=rollout, correction="mis-token")
    b, mb = policy_loss(*args, clip_low=0.8, clip_high=1.2, rollout_logprobs=rollout,
                        correction="mis-token-two-sided", correction_cap_low=1e-300)
    assert torch.equal(a, b) and torch.equal(ma["mis_maskfrac"], mb["mis_maskfrac"])
    assert mb["mis_maskfrac_low"].item() == 0.0


def test_band_is_checked_where_it_is_declared():
    with pytest.raises(ConfigError, match="correction_cap_low"):
        LossConfig(correction="mis-token-two-sided", correction_cap=2.0, correction_cap_low=2.0)
    LossConfig(correction="tis", correction_cap=0.4)  # the band only matters to its correction
    with pytest.raises(ConfigError, match="correction_cap_low"):
        from_dict(PolicyLossConfig, {"correction": "mis-token-two-sided", "correction_cap_low": 0.0})
    cfg = from_dict(PolicyLossConfig, {"correction": "mis-token-two-sided", "correction_cap_low": 0.2})
    assert cfg.loss_config().correction_cap_low == 0.2


def test_a_new_correction_is_one_registered_function():
    @register_correction("test-halve")
    def halve(log_w, mask, config):
        return torch.where(mask, 0.5, 0.0).to(log_w.dtype), {}

    try:
        lp = torch.tensor([[0.1, -0.2], [0.3, 0.0]], dtype=D)
        args = (lp, torch.zeros(2, 2, dtype=D), torch.tensor([1.0, -1.0], dtype=D),
                torch.ones(2, 2, dtype=torch.bool))
        kw = dict(clip_low=0.8, clip_high=1.2, rollout_logprobs=torch.zeros(2, 2, dtype=D))
        plain, _ = policy_loss(*args, **kw)
        halved, m = policy_loss(*args, correction="test-halve", **kw)
        assert halved.item() == pytest.approx(0.5 * plain.item(), rel=1e-12)
        assert m["is_weight_mean"].item() == 0.5
        with pytest.raises(ValueError, match="already registered"):
            register_correction("test-halve")(halve)
    finally:
        CORRECTIONS.pop("test-halve")
    with pytest.raises(ConfigError, match="correction"):
        LossConfig(correction="test-halve")


def test_yaml_names_are_the_registered_builtins():
    """PolicyLossConfig.correction is a Literal (so from_dict names the allowed values);
    it must list exactly the corrections registered in corrections.py."""
    from typing import get_args

    from megatron_calibclip.rl.corrections import CORRECTION_MODES, CorrectionName

    assert sorted(get_args(CorrectionName)) == sorted(CORRECTIONS)
    assert set(CORRECTION_MODES) == set(CORRECTIONS) - {"none"}
    with pytest.raises(ConfigError, match=r"loss\.correction: 'icepop' is not one of"):
        from_dict(PolicyLossConfig, {"correction": "icepop"}, "loss")
