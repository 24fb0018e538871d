"""DistributedHistogram on one process: slot membership, queries vs numpy, zoom, errors."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_calibclip.calibration import DistributedHistogram
from tests.calibration.reference import interpolated_ok, smallest_reaching, snapped_ok

GRIDS = [(-4.0, 4.0, 16384), (-3.3, 2.7, 1000), (-1.0, 1.0, 7)]
special = st.sampled_from([0.0, -0.0, 1e-30, -1e-30, 2.0 ** -11, -4.0, 4.0, -3.3, 2.7, 1e300, -1e300,
                           math.log(0.8), math.nextafter(-4.0, 0.0), math.nextafter(4.0, 9.0)])
values_st = st.lists(st.one_of(st.floats(-6, 6, allow_nan=False), special), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(values=values_st, grid=st.sampled_from(GRIDS))
def test_slot_membership_matches_float64_edge_comparisons(values, grid):
    lo, hi, bins = grid
    h = DistributedHistogram(lo, hi, bins)
    x = torch.tensor(values, dtype=torch.float64)
    slots = h.slots(x).tolist()
    edges = h.edges.tolist()
    assert edges[0] == lo and edges[-1] == hi
    for v, s in zip(values, slots):
        if s == 0:
            assert v <= lo
        elif s == bins + 1:
            assert v > hi
        else:
            assert edges[s - 1] < v <= edges[s], (v, s)


@settings(max_examples=80, deadline=None)
@given(
    values=values_st,
    weighted=st.booleans(),
    q=st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0, 0.5])),
    grid=st.sampled_from(GRIDS),
    seed=st.integers(0, 2 ** 31),
)
def test_queries_match_exact_sorting(values, weighted, q, grid, seed):
    lo, hi, bins = grid
    x = np.array(values, dtype=np.float64)
    w = np.random.default_rng(seed).uniform(0.1, 3.0, len(x)) if weighted else np.ones(len(x))
    h = DistributedHistogram(lo, hi, bins, channels=("w",), keep_samples=True)
    h.add(torch.tensor(x), {"w": torch.tensor(w)})
    assert h.all_reduce() == 0  # no process group: local data is global
    target = q * w.sum()
    exact = smallest_reaching(x, w, target)
    width = (hi - lo) / bins
    snapped = h.threshold("w", target, interpolate=False)
    assert snapped_ok(snapped, exact, lo, hi, width), (snapped, exact)
    assert interpolated_ok(h.threshold("w", target, interpolate=True), exact, lo, hi, width)
    assert h.quantile("w", q, interpolate=False) == snapped
    slot = h.locate("w", target)
    if 1 <= slot <= bins:  # second pass on the bracketing bin: float precision
        z = h.zoom(slot, bins=4096)
        z.all_reduce()
        fine = z.threshold("w", target, interpolate=False)
        assert snapped_ok(fine, exact, lo, hi, width / 4096)
        if width / 4096 <= 1e-6:  # the default grid: float precision after one more pass
            assert 0.0 <= fine - exact <= 1e-6
        assert abs(z.threshold("w", target, interpolate=True) - exact) <= width / 4096 + 1e-12
        assert z.total("w") == pytest.approx(w.sum(), rel=1e-12)


def test_out_of_range_values_are_counted_not_dropped():
    h = DistributedHistogram(-1.0, 1.0, 8, channels=("n", "m"))
    x = torch.tensor([-50.0, -1.0, -0.99, 0.0, 1.0, 1.0001, 30.0])
    h.add(x, {"n": None, "m": torch.arange(1.0, 8.0)})
    h.all_reduce()
    n, m = h.counts("n"), h.counts("m")
    assert n[0] == 2 and n[-1] == 2 and n.sum() == 7  # -50 and -1.0 (right-closed) / 1.0001 and 30
    assert m[0] == 1 + 2 and m[-1] == 6 + 7 and m.sum() == 28
    assert h.quantile("n", 0.25, interpolate=False) == -1.0  # 2nd smallest is -1.0 itself
    assert h.quantile("n", 0.2, interpolate=False) == -1.0  # answer below the range -> lo
    assert h.quantile("n", 1.0, interpolate=False) == math.inf  # above the range -> +inf
    assert h.quantile("n", 1.0, interpolate=True) == 1.0  # interpolated answers are clipped
    assert h.above("m", 0) == 28 - 3 and h.at_most("m", 8) == 28 - 13


def test_payload_is_independent_of_token_count_and_errors_are_clear():
    small, large = DistributedHistogram(), DistributedHistogram()
    small.add(torch.zeros(10))
    large.add(torch.randn(200_000))
    assert small.payload_bytes == large.payload_bytes == (16384 + 2) * 8
    with pytest.raises(ValueError, match="finite"):
        small.add(torch.tensor([0.0, float("nan")]))
    with pytest.raises(RuntimeError, match="all_reduce"):
        large.zoom(5)
    large.all_reduce()
    with pytest.raises(RuntimeError, match="after all_reduce"):
        large.add(torch.zeros(1))
    with pytest.raises(RuntimeError, match="keep_samples"):
        large.zoom(5)
    with pytest.raises(ValueError, match="lo < hi"):
        DistributedHistogram(1.0, -1.0)
    with pytest.raises(KeyError, match="unknown channel"):
        DistributedHistogram().add(torch.zeros(1), {"mass": None})
