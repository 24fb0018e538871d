"""GRPO / Dr. GRPO advantages against hand computations; zero-variance groups."""
import math

import pytest
import torch

from megatron_calibclip.rl import dr_grpo_advantages, grpo_advantages, zero_variance_groups


def test_grpo_hand_case():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    adv = grpo_advantages(r, eps=0.0)
    assert adv.flatten().tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])
    biased = grpo_advantages(r, eps=0.0, unbiased_std=False)  # std 0.5
    assert biased.flatten().tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])


def test_dr_grpo_is_mean_centred_only():
    r = torch.tensor([3.0, 1.0, 2.0, 10.0, 20.0, 30.0])
    adv = dr_grpo_advantages(r, group_size=3)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, -10.0, 0.0, 10.0])
    assert adv.shape == r.shape


def test_group_of_one_is_zero_not_nan():
    r = torch.tensor([1.0, 0.0, 0.5])
    for normalize_std in (True, False):
        adv = grpo_advantages(r, group_size=1, normalize_std=normalize_std)
        assert adv.tolist() == [0.0, 0.0, 0.0]
    assert zero_variance_groups(r, group_size=1).all()


def test_identical_rewards_give_exact_zero():
    # 0.1 is not exactly representable; the mean of three copies need not equal 0.1 bit for bit
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    adv = grpo_advantages(r, eps=1e-12)
    assert adv[0].tolist() == [0.0, 0.0, 0.0]
    assert adv[1].tolist() == [0.0, 0.0, 0.0]
    assert adv[2].abs().sum() > 0
    assert zero_variance_groups(r).tolist() == [True, True, False]


def test_one_dimensional_groups_are_contiguous():
    r = torch.tensor([0.0, 1.0, 5.0, 5.0])
    adv = grpo_advantages(r, group_size=2, eps=0.0)
    s = math.sqrt(0.5)  # unbiased std of {0, 1}
    assert adv.tolist() == pytest.approx([-0.5 / s, 0.5 / s, 0.0, 0.0])


@pytest.mark.parametrize(
    "rewards, kw, name",
    [
        (torch.tensor([1.0, 2.0, 3.0]), dict(group_size=2), "group_size"),
        (torch.tensor([1.0, 2.0]), dict(), "group_size"),
        (torch.tensor([[1.0, 2.0]]), dict(group_size=3), "group_size"),
        (torch.tensor([1.0, float("nan")]), dict(group_size=2), "rewards"),
        (torch.zeros(2, 2, 2), dict(), "rewards"),
        (torch.zeros(0, 4), dict(), "rewards"),
    ],
)
def test_errors(rewards, kw, name):
    with pytest.raises(ValueError, match=name):
        grpo_advantages(rewards, **kw)
