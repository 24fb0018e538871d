"""Damaged checkpoints (truncated .distcp / .metadata, a missing file): the error names the
step folder and the file in one line, and a resume falls back to the newest intact
checkpoint with a warning (2 gloo ranks, the real trainer)."""
from __future__ import annotations

import json
import os

import pytest

from megatron_calibclip.checkpoint.integrity import damaged_file
from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

CFG = merge(TINY_TRAIN, {"run": {"name": "damaged", "steps": 3, "save_every": 1, "plot": False,
                                 "tensorboard": False}, "warmup": {"steps": 2}})


def _body(rank, world_size, cfg_dict):
    """(outcome, steps run or the error, what the rank wrote to stderr)."""
    import contextlib
    import io

    from megatron_calibclip.checkpoint.errors import DamagedCheckpointError
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            steps = [r["step"] for r in train(from_dict(TrainConfig, cfg_dict))["records"]]
            return "ran", steps, err.getvalue()
        except DamagedCheckpointError as error:
            return "damaged", str(error), err.getvalue()


def _truncate(path, keep=0.5):
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(int(size * keep))


def _folders(root):
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def _outcomes(results):
    return [r[:2] for r in results]


def test_resume_skips_a_damaged_latest_and_names_the_file(dist_pool, tmp_path):
    pool = dist_pool(2)
    cfg = merge(CFG, {"run": {"output_dir": str(tmp_path)}})
    assert _outcomes(pool.run(_body, cfg, timeout=300)) == [("ran", [0, 1, 2])] * 2
    root = tmp_path / "damaged" / "checkpoints"
    folders = _folders(root)
    assert len(folders) == 3 and (root / "latest").read_text().strip() == folders[-1].name
    assert all(damaged_file(f) is None for f in folders)

    _truncate(folders[-1] / "__0_0.distcp")  # the newest checkpoint (after step 2) is damaged
    bad = damaged_file(folders[-1])
    assert bad[0] == "__0_0.distcp" and bad[1].startswith("truncated")
    results = pool.run(_body, merge(cfg, {"run": {"steps": 4}}), timeout=300)
    assert _outcomes(results) == [("ran", [2, 3])] * 2  # resumed after step 1
    err = results[0][2]  # rank 0 warns, naming the folder and the file
    assert f"{folders[-1].name}/__0_0.distcp truncated" in err and "newest intact" in err, err
    metrics = (tmp_path / "damaged" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x)["step"] for x in metrics]
    assert steps == [0, 1, 2, 3]  # trimmed to the checkpoint resumed from, then continued

    for folder in _folders(root):  # now every checkpoint is damaged, in several ways
        _truncate(folder / ".metadata", keep=0.3)
    results = pool.run(_body, merge(cfg, {"run": {"steps": 6}}), timeout=300)
    for status, message, _ in results:
        assert status == "damaged" and "\n" not in message, message
        assert "no intact checkpoint" in message and "/.metadata unreadable" in message
        assert all(f.name in message for f in _folders(root))


def test_damaged_file_names_each_kind_of_damage(dist_pool, tmp_path):
    cfg = merge(CFG, {"run": {"output_dir": str(tmp_path), "steps": 1}})
    assert _outcomes(dist_pool(2).run(_body, cfg, timeout=300)) == [("ran", [0])] * 2
    folder = _folders(tmp_path / "damaged" / "checkpoints")[-1]
    assert damaged_file(folder) is None
    os.rename(folder / "__1_0.distcp", folder / "moved")
    assert damaged_file(folder) == ("__1_0.distcp", "missing")
    os.rename(folder / "moved", folder / "__1_0.distcp")
    (folder / "calibclip.json").write_text("{")
    assert damaged_file(folder)[0] == "calibclip.json"
