"""The rule study's plumbing: recorded calibration inputs survive compaction, and the study
reads them back into the same bounds the clipper computed; the model grid runs and is sane."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch

from megatron_calibclip.calibration import CalibratedClipper, CalibrationConfig
from megatron_calibclip.calibration.config import UPPER_RULES

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "calibration" / "bench_upper_rules.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_upper_rules", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _minibatch(gen, n):
    lr16 = torch.randn(n, generator=gen, dtype=torch.float64) * 0.2
    lr8 = lr16 + torch.randn(n, generator=gen, dtype=torch.float64) * 0.1
    adv = torch.where(torch.arange(n) % 2 == 0, -1.0, 1.0).double()
    mask = torch.rand(n, generator=gen) < 0.8
    lr8[~mask] = float("nan")  # masked positions may hold anything
    return lr8.float(), lr16.float(), adv.float(), mask


def test_recorded_inputs_round_trip_through_compaction(tmp_path):
    bench = _bench()
    cfg = CalibrationConfig(record_dir=str(tmp_path / "rec"), widen_only=False)
    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.2)
    gen = torch.Generator().manual_seed(3)
    results, valid_neg = [], []
    for step in (0, 4):
        acc = clipper.new_accumulator()
        batches = [_minibatch(gen, 600) for _ in range(2)]
        for b in batches:
            acc.add(*b)
        result = acc.compute()
        clipper.save_inputs(acc, step, result)
        results.append(result)
        valid_neg.append(sum(int(((b[2] < 0) & b[3]).sum()) for b in batches))
    out = tmp_path / "rec.npz"
    assert bench.compact(str(tmp_path / "rec"), str(out)) == 2
    rows = bench.study_recorded([str(out)], min_clipped=20)
    assert [r["calibration"] for r in rows] == ["step000000", "step000004"]
    for row, result, n_neg in zip(rows, results, valid_neg):
        assert row["n_neg"] == n_neg == result.n_neg  # only valid tokens were kept
        assert row["k_neg_bf16"] == result.n_neg_clipped_shadow
        # the study's log_scale run is the clipper's own calibration (same rule, widen-only off)
        assert row["rules"]["log_scale"]["L"] == result.lower
        assert row["rules"]["log_scale"]["H"] == result.upper


def test_model_grid_runs_and_log_scale_is_never_infinite():
    bench = _bench()
    cells = bench.study_gaussian(trials=3, min_clipped=20, quick=True, seed=0)
    assert len(cells) == len(list(bench.gaussian_cells(quick=True)))
    for cell in cells:
        rules = cell["rules"]
        assert set(rules) == set(UPPER_RULES)
        assert rules["log_scale"]["upper_infeasible_or_out_of_range_rate"] == 0.0
        for summary in rules.values():
            assert 0.0 <= summary["fallback_rate"] <= 1.0
            for key in ("H_p5", "H_p50", "H_p95"):
                assert summary[key] is None or (math.isfinite(summary[key]) and summary[key] > 1.0)
            assert np.isfinite(summary["kept_mass_ratio_vs_bf16_p50"])
