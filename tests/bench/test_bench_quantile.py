"""`calibclip bench quantile`: the command path end to end at small sizes (2 gloo ranks spawned by
the command itself), its JSON, and that it fails fast and clearly instead of hanging."""
import json

import pytest

from megatron_calibclip.bench.quantile import bytes_bound, first_pass_bytes, parse_tokens
from megatron_calibclip.calibration import CalibrationConfig
from megatron_calibclip.calibration.solver import SCALARS
from megatron_calibclip.cli import main


def _run(capsys, *argv):
    code = main(["bench", "quantile", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_bench_quantile_json_bytes_and_error(capsys):
    sizes = [20000, 40000]
    code, out, err = _run(capsys, "--ranks", "2", "--tokens", ",".join(map(str, sizes)), "--json",
                          "--repeats", "1", "--seed", "3")
    report = json.loads(out)  # stdout is exactly one JSON object
    assert code == 0, (err, report.get("targets"))
    assert report["ok"] is True
    targets = report["targets"]
    assert targets["error_le_1e-4_log_r"] is True and targets["bytes_independent_of_token_count"] is True
    assert targets["bounds_identical_on_all_ranks"] is True
    assert targets["faster_than_baseline_from_1M_tokens_per_rank"] is None  # below 1M tokens per rank
    assert report["tokens_are"] == "per_rank" and report["ranks"] == 2 and report["seed"] == 3
    assert report["tokens_per_rank"] == sizes and report["tokens_global"] == [2 * n for n in sizes]
    settings = report["estimator_settings"]["default"]
    cfg = CalibrationConfig()
    assert settings["bins"] == cfg.bins and settings["refine"] is cfg.refine is True
    assert settings["resolution_log_r"] == cfg.resolution and settings["bytes_bound_per_rank"] == bytes_bound(cfg)
    rows = report["results"]
    assert [r["tokens_per_rank"] for r in rows] == sizes
    for row in rows:
        assert row["same_bounds_on_all_ranks"] is True
        base, est = row["baseline"], row["estimator"]["default"]
        for method in (base, est):
            assert method["wall_time_s"] > 0 and method["bytes_per_rank"] > 0 and method["collectives"] >= 1
        # the baseline gathers 13 bytes per token from every rank
        assert base["bytes_per_rank"] == 13 * row["tokens_global"]
        # error <= 1e-4 in log r for L and for H (vs the exact H for the exact L*)
        assert abs(est["error_log_lower"]) <= 1e-4 and abs(est["error_log_upper"]) <= 1e-4
        assert 0 <= est["error_log_lower"] <= cfg.resolution * (1 + 1e-9)
        assert est["targets"]["error"]["pass"] is True
        # the speed target applies from 1M tokens per rank on only
        assert est["targets"]["faster_than_baseline"] == {"applies": False, "pass": None}
    # estimator bytes do not depend on the token count (the baseline's double with it): the
    # first all-reduce is the whole histogram, the same at both counts; the refinement
    # all-reduce zooms into L's bin and m in 1..8 candidate bins of H (m follows where the
    # answers fall, not the count), so the total stays under a bound set by the settings alone
    rb = cfg.refine_bins
    for row in rows:
        calls = row["estimator"]["default"]["bytes_per_collective"]
        assert len(calls) == 2 and calls[0] == first_pass_bytes(cfg) == (4 * (cfg.bins + 2) + len(SCALARS)) * 8
        m = (calls[1] // 8 - 2 * (rb + 2) - 4) / (2 * rb)
        assert m == int(m) and 1 <= m <= 8, m
        assert sum(calls) <= bytes_bound(cfg) == 1_114_360  # 15 exact sums ride along
    assert rows[1]["baseline"]["bytes_per_rank"] == 2 * rows[0]["baseline"]["bytes_per_rank"]
    judged = report["judged"]["default"]["bytes_independent_of_tokens"]
    assert judged["pass"] is True and judged["bound_per_rank"] == bytes_bound(cfg)


def test_bad_arguments_exit_2_without_spawning(capsys):
    code, out, err = _run(capsys, "--tokens", "12x", "--json")
    assert code == 2 and out == "" and "--tokens" in err
    code, _, err = _run(capsys, "--ranks", "0")
    assert code == 2 and "--ranks" in err
    code, _, err = _run(capsys, "--variants", "nope")
    assert code == 2 and "nope" in err
    assert parse_tokens("1000000, 4e6,2_000") == [1000000, 4000000, 2000]
    with pytest.raises(ValueError):
        parse_tokens("10")


def test_deadline_kills_the_ranks_and_reports(capsys):
    # 1 s is less than the ranks need to start: the command must give up, not hang
    code, out, err = _run(capsys, "--ranks", "2", "--tokens", "20000", "--timeout", "1", "--json")
    assert code == 3
    assert "did not finish within --timeout 1 s" in err
    report = json.loads(out)
    assert report["ok"] is False and "did not finish within --timeout 1 s" in report["error"]
