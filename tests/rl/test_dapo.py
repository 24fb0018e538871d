"""DAPO: overlong punishment at each boundary, dynamic-sampling filter and refill contract."""
import pytest
import torch

from megatron_calibclip.rl import DynamicSamplingBuffer, dynamic_sampling_filter, expand_group_mask, overlong_penalty


def test_overlong_boundaries():
    # L_max = 20, L_cache = 4: free up to 16, linear ramp to -1 at 20, -1 beyond
    lengths = [0, 15, 16, 17, 18, 19, 20, 21, 1000]
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    got = overlong_penalty(lengths, max_length=20, cache_length=4)
    assert got.tolist() == pytest.approx(expected)
    assert got.dtype == torch.float32


def test_overlong_dapo_paper_numbers():
    # DAPO: 16,384 expected + 4,096 cache -> L_max = 20,480
    got = overlong_penalty(torch.tensor([16384, 16385, 18432, 20480, 20481]), max_length=20480, cache_length=4096)
    assert got.tolist() == pytest.approx([0.0, -1 / 4096, -0.5, -1.0, -1.0])


@pytest.mark.parametrize(
    "lengths, kw, name",
    [
        ([1, 2], dict(max_length=10, cache_length=0), "cache_length"),
        ([1, 2], dict(max_length=10, cache_length=11), "cache_length"),
        ([1, 2], dict(max_length=0, cache_length=1), "max_length"),
        ([1.5], dict(max_length=10, cache_length=2), "lengths"),
        ([-1], dict(max_length=10, cache_length=2), "lengths"),
    ],
)
def test_overlong_errors(lengths, kw, name):
    with pytest.raises(ValueError, match=name):
        overlong_penalty(lengths, **kw)


def test_dynamic_sampling_filter():
    correct = torch.tensor([[True, True, True], [False, False, False], [True, False, False], [False, True, True]])
    assert dynamic_sampling_filter(correct).tolist() == [False, False, True, True]
    assert dynamic_sampling_filter(correct.flatten(), group_size=3).tolist() == [False, False, True, True]
    assert expand_group_mask(torch.tensor([True, False]), 2).tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="correct"):
        dynamic_sampling_filter(torch.ones(2, 3))  # rewards, not correctness
    with pytest.raises(ValueError, match="group_size"):
        dynamic_sampling_filter(correct.flatten(), group_size=5)


def _round(names, pattern):
    """pattern: per group 'm' (mixed -> kept), 'a' (all right), 'n' (none right)."""
    rows = {"m": [True, False], "a": [True, True], "n": [False, False]}
    return names, torch.tensor([rows[p] for p in pattern])


def test_buffer_refills_fifo_and_drops_surplus():
    buf = DynamicSamplingBuffer(3)
    assert buf.add(*_round(["p0", "p1", "p2"], "man")) == 1
    assert not buf.full
    assert buf.add(*_round(["p3", "p4", "p5"], "mmm")) == 3
    assert buf.full and len(buf) == 4
    assert buf.pop() == ["p0", "p3", "p4"]
    assert len(buf) == 0  # surplus p5 dropped (DAPO reference behaviour)
    assert buf.stats() == {"seen_groups": 6.0, "kept_groups": 4.0, "keep_rate": pytest.approx(4 / 6)}


def test_buffer_carry_over():
    buf = DynamicSamplingBuffer(2, carry_over=True)
    buf.add(*_round(["p0", "p1", "p2"], "mmm"))
    assert buf.pop() == ["p0", "p1"]
    assert len(buf) == 1
    buf.add(*_round(["p3"], "m"))
    assert buf.pop() == ["p2", "p3"]


def test_buffer_max_rounds_and_partial():
    buf = DynamicSamplingBuffer(4, max_rounds=2)
    buf.add(*_round(["p0", "p1"], "am"))
    assert not buf.exhausted
    buf.add(*_round(["p2", "p3"], "nm"))
    assert buf.exhausted
    with pytest.raises(RuntimeError, match="dynamic sampling"):
        buf.pop()
    assert buf.pop(allow_partial=True) == ["p1", "p3"]
    assert not buf.exhausted  # rounds reset for the next step


def test_buffer_errors():
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSamplingBuffer(0)
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSamplingBuffer(2, max_rounds=0)
    buf = DynamicSamplingBuffer(2)
    with pytest.raises(ValueError, match="groups"):
        buf.add(["p0"], torch.tensor([[True, False], [True, False]]))
