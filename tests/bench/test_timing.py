"""bench.timing.interleaved_times: every candidate runs once per round, in turn, after one
warm-up call; min <= median per candidate."""
from megatron_calibclip.bench.timing import interleaved_times


def test_round_robin_order_and_counts():
    calls = []
    out = interleaved_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert set(out) == {"a", "b"}
    assert all(0 <= t["min_s"] <= t["median_s"] for t in out.values())
