"""Re-running into an existing run directory never shortens or replaces its results unless
asked (2 gloo ranks, the real trainer): another configuration and run.checkpoint=false are
refused on every rank before anything is written; run.steps at or below the steps done says
so and writes nothing; run.overwrite=true replaces the run; a continuation appends."""
from __future__ import annotations

import json

import pytest

from megatron_calibclip.trainer.run_dir import config_differences
from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

CFG = merge(TINY_TRAIN, {"run": {"name": "guarded", "steps": 2, "tensorboard": False},
                         "warmup": {"steps": 2}})


def _body(rank, world_size, cfg_dict):
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train
    from megatron_calibclip.trainer.run_dir import RunDirError

    try:
        return "ran", [r["step"] for r in train(from_dict(TrainConfig, cfg_dict))["records"]]
    except RunDirError as err:
        return "refused", str(err)


def _snapshot(run_dir):
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def test_existing_results_are_never_replaced_unless_asked(dist_pool, tmp_path, capsys):
    pool = dist_pool(2)
    cfg = merge(CFG, {"run": {"output_dir": str(tmp_path)}})
    run_dir = tmp_path / "guarded"
    assert pool.run(_body, cfg, timeout=300) == [("ran", [0, 1])] * 2
    before = _snapshot(run_dir)
    assert {"metrics.jsonl", "config.yaml", "summary.png"} <= set(before)

    for change, words in [({"optimizer": {"lr": 2e-3}}, ["another configuration", "optimizer.lr"]),
                          ({"run": {"checkpoint": False}},
                           ["2 steps of metrics", "run.checkpoint is false"])]:
        results = pool.run(_body, merge(cfg, change), timeout=300)
        for status, message in results:  # every rank stops, with the same one-line reason
            assert status == "refused" and all(w in message for w in words), message
            assert "run.overwrite=true" in message and "\n" not in message
        assert _snapshot(run_dir) == before, change

    capsys.readouterr()
    assert pool.run(_body, cfg, timeout=300) == [("ran", [])] * 2  # run.steps == steps done
    assert _snapshot(run_dir) == before

    assert pool.run(_body, merge(cfg, {"run": {"steps": 3}}), timeout=300) == [("ran", [2])] * 2
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # continued, earlier records kept

    other = merge(cfg, {"optimizer": {"lr": 2e-3}, "run": {"overwrite": True}})
    assert pool.run(_body, other, timeout=300) == [("ran", [0, 1])] * 2
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    assert "lr: 0.002" in (run_dir / "config.yaml").read_text()


def test_config_differences_ignore_length_and_display_fields():
    saved = {"run": {"steps": 4, "plot": True, "seed": 0}, "optimizer": {"lr": 1e-3}, "old": 1}
    current = {"run": {"steps": 8, "plot": False, "seed": 0}, "optimizer": {"lr": 1e-3}, "new": 2}
    assert config_differences(saved, current) == []
    assert config_differences(saved, {**current, "optimizer": {"lr": 2e-3}}) == ["optimizer.lr"]


def test_run_gemm_path_holds_for_the_run_and_is_restored(monkeypatch):
    """run.gemm_path: the run's GEMMs take the named path (whatever $CALIBCLIP_GEMM says);
    the process's path is restored afterwards (in-process callers, tests); auto defers."""
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.fp8.gemm import gemm_path
    from megatron_calibclip.trainer import TrainConfig, loop
    from tests.train_configs import TINY_TRAIN, merge

    seen = []
    monkeypatch.setattr(loop, "_train", lambda cfg, ckpt, init: seen.append(gemm_path()) or {})
    monkeypatch.setenv("CALIBCLIP_GEMM", "native")
    for path in ("fp32", "exact", "auto"):
        loop.train(from_dict(TrainConfig, merge(TINY_TRAIN, {"run": {"gemm_path": path}})))
    assert seen == ["fp32", "exact", "native"]
    assert gemm_path() == "native"
