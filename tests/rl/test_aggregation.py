"""Each aggregation mode against a hand computation; the DP-normaliser contract; errors."""
import pytest
import torch

from megatron_calibclip.rl import aggregate, masked_mean, policy_loss

NAN = float("nan")
# two real sequences of 3 and 2 tokens (values 1..5), padding holds NaN, a third row is empty
VALUES = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, 5.0, NAN, NAN], [NAN, NAN, NAN, NAN]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True, False], [True, True, False, False], [False] * 4])


def test_token_mean():
    assert aggregate(VALUES, MASK, "token-mean").item() == pytest.approx(15 / 5)


def test_seq_mean_token_mean():
    # (6/3 + 9/2) / 2 sequences; the empty row is not a sequence
    assert aggregate(VALUES, MASK, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.5) / 2)


def test_seq_mean_token_sum_norm():
    # default T_max = padded length 4: (6/4 + 9/4) / 2
    assert aggregate(VALUES, MASK, "seq-mean-token-sum-norm").item() == pytest.approx(15 / 8)
    # a fixed generation budget of 10: (6/10 + 9/10) / 2
    got = aggregate(VALUES, MASK, "seq-mean-token-sum-norm", max_response_length=10)
    assert got.item() == pytest.approx(0.75)


def test_global_normalisers():
    assert aggregate(VALUES, MASK, "token-mean", num_tokens=10).item() == pytest.approx(1.5)
    assert aggregate(VALUES, MASK, "token-mean", num_tokens=torch.tensor(10)).item() == pytest.approx(1.5)
    assert aggregate(VALUES, MASK, "seq-mean-token-mean", num_sequences=4).item() == pytest.approx(6.5 / 4)
    got = aggregate(VALUES, MASK, "seq-mean-token-sum-norm", num_sequences=5, max_response_length=10)
    assert got.item() == pytest.approx(1.5 / 5)


def test_seq_num_tokens_for_context_parallel_split():
    # this shard holds 3 of sequence 0's 6 tokens and 2 of sequence 1's 4 tokens
    got = aggregate(VALUES, MASK, "seq-mean-token-mean", seq_num_tokens=torch.tensor([6, 4, 0]))
    assert got.item() == pytest.approx((6 / 6 + 9 / 4) / 2)


def test_one_dimensional_is_one_sequence():
    v = torch.tensor([1.0, 2.0, 6.0])
    m = torch.tensor([True, True, False])
    assert aggregate(v, m, "token-mean").item() == pytest.approx(1.5)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx(1.5)
    assert aggregate(v, m, "seq-mean-token-sum-norm").item() == pytest.approx(1.0)


def test_modes_differ_through_policy_loss():
    """GRPO's per-sequence mean weights short answers' tokens more than DAPO's token-mean."""
    lp = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, False, False], [True, True, True, True]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    for mode, g_short, g_long in (("token-mean", 1 / 5, 1 / 5), ("seq-mean-token-mean", 1 / 2, 1 / 8),
                                  ("seq-mean-token-sum-norm", 1 / 8, 1 / 8)):
        lp.grad = None
        loss, _ = policy_loss(lp, lp.detach(), adv, mask, clip_low=0.8, clip_high=1.2, loss_agg_mode=mode)
        loss.backward()
        assert lp.grad[0, 0].item() == pytest.approx(-g_short), mode
        assert lp.grad[1, 0].item() == pytest.approx(-g_long), mode


def test_masked_mean_rows():
    got = masked_mean(VALUES, MASK, dim=-1)
    assert got.tolist() == pytest.approx([2.0, 4.5, 0.0])


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(mode="sum"), "mode"),
        (dict(mode="seq-mean-token-mean", num_tokens=5), "num_tokens"),
        (dict(mode="token-mean", num_sequences=2), "num_sequences"),
        (dict(mode="token-mean", max_response_length=4), "max_response_length"),
        (dict(mode="token-mean", seq_num_tokens=torch.ones(3)), "seq_num_tokens"),
        (dict(mode="seq-mean-token-mean", seq_num_tokens=torch.ones(3)), "seq_num_tokens"),
        (dict(mode="seq-mean-token-mean", seq_num_tokens=torch.ones(2)), "seq_num_tokens"),
        (dict(mode="seq-mean-token-sum-norm", max_response_length=2), "max_response_length"),
        (dict(mode="token-mean", num_tokens=0), "num_tokens"),
        (dict(mode="seq-mean-token-mean", num_sequences=1), "num_sequences"),
    ],
)
def test_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        aggregate(VALUES, MASK, **kw)


def test_bad_values_and_mask():
    with pytest.raises(ValueError, match="mask"):
        aggregate(VALUES, torch.zeros_like(MASK))
    with pytest.raises(ValueError, match="mask"):
        aggregate(VALUES, MASK[:2])
    bad = VALUES.clone()
    bad[0, 0] = NAN
    with pytest.raises(ValueError, match="values"):
        aggregate(bad, MASK)
