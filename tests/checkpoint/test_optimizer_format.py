"""The distributed optimizer's checkpoint formats (checkpoint/optimizer_format.py, issue 37
finding 6): a dp_reshardable resume is bit-identical to the uninterrupted run, across a DP
change too; the format is recorded; a TP change with dp_reshardable optimizer state fails in
one line that says what to do, while the weights alone still reshard."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.checkpoint.helpers import build_trainable
from tests.checkpoint.test_manager import MBS, SEQ, _train_step

pytestmark = [pytest.mark.dist, pytest.mark.te_stand_in]


def _batches(cfg, n):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, cfg.vocab_size, (MBS, SEQ), generator=g) for _ in range(n)]


def _steps(cfg, ddp, opt, batches):
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses = []
    for full in batches:  # the same global batch at any DP: each DP rank takes its rows
        rows = full.shape[0] // dp
        losses.append(_train_step(cfg, ddp, opt, full[rank * rows:(rank + 1) * rows]))
    return losses


def _weights(model, cfg):
    from tests.dist_utils import full_state

    return full_state(model, cfg.num_layers, cfg.vocab_size, grads=False)


def _resume_body(rank, world_size, root, fmt, resume_tp):
    from megatron_calibclip.checkpoint import CheckpointInfo, CheckpointManager
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel

    cfg = get_preset("tiny")
    batches = _batches(cfg, 4)
    with model_parallel():  # DP=2: the optimizer's states are sharded over the two ranks
        model, ddp, opt = build_trainable(cfg, seed=0, distributed=True)
        _steps(cfg, ddp, opt, batches)
        straight = _weights(model, cfg)
    manager = CheckpointManager(root, optimizer_format=fmt)
    with model_parallel():
        model, ddp, opt = build_trainable(cfg, seed=0, distributed=True)
        _steps(cfg, ddp, opt, batches[:2])
        folder = manager.save(2, ddp, opt)
    written = CheckpointInfo.read(folder).optimizer_format
    with model_parallel(tp=resume_tp):  # DP = 2 / resume_tp
        model, ddp, opt = build_trainable(cfg, seed=7, distributed=True)
        manager.load_latest(ddp, opt)
        _steps(cfg, ddp, opt, batches[2:])
        resumed = _weights(model, cfg)
    return written, straight, resumed


def _save_body(rank, world_size, root, steps):
    """The first `steps` steps at DP=2, saved with the default format (dp_reshardable)."""
    from megatron_calibclip.checkpoint import CheckpointManager
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel

    cfg = get_preset("tiny")
    with model_parallel():
        model, ddp, opt = build_trainable(cfg, seed=0, distributed=True)
        _steps(cfg, ddp, opt, _batches(cfg, 4)[:steps])
        CheckpointManager(root).save(steps, ddp, opt)
        return _weights(model, cfg)


def _continue_body(rank, world_size, root, steps):
    from megatron_calibclip.checkpoint import CheckpointManager
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel

    cfg = get_preset("tiny")
    with model_parallel():
        model, ddp, opt = build_trainable(cfg, seed=7, distributed=True)
        CheckpointManager(root).load_latest(ddp, opt)
        _steps(cfg, ddp, opt, _batches(cfg, 4)[steps:])
        return _weights(model, cfg)


def test_dp_reshardable_resume_is_bit_identical(dist_pool, tmp_path):
    """The model-space formats (fully_reshardable, its mem-efficient variant) do not load into
    torch's Adam inside megatron's distributed optimizer (the CPU: its loader skips the
    per-parameter 'step' that FusedAdam does not have), and the plain variant gathers
    through CUDA: the trainer refuses them on the CPU (tests/trainer/test_mixed_precision.py)."""
    results = dist_pool(2).run(_resume_body, str(tmp_path / "ckpt"), "dp_reshardable", 1)
    for written, straight, resumed in results:
        assert written == "dp_reshardable"
        assert straight.keys() == resumed.keys()
        for name, value in straight.items():
            assert np.array_equal(value, resumed[name]), f"weight {name} differs"


def test_dp_reshardable_resumes_at_another_dp(dist_pool, tmp_path):
    """Written by two DP ranks, resumed by one (DP=1): each rank's shard is found again; the
    continued run matches the uninterrupted DP=2 one to fp32 summation order."""
    root = str(tmp_path / "ckpt")
    straight = dist_pool(2).run(_save_body, root + "-straight", 4)[0]
    dist_pool(2).run(_save_body, root, 2)
    resumed = dist_pool(1).run(_continue_body, root, 2)[0]
    for name, value in straight.items():
        np.testing.assert_allclose(resumed[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    first = dist_pool(1).run(_continue_body, root, 4)[0]  # loaded, not stepped: the control
    assert any(not np.allclose(first[n], straight[n], rtol=1e-4, atol=1e-6) for n in straight)


def _tp_change_body(rank, world_size, root):
    """Written at TP=1 x DP=2, loaded at TP=2 x DP=1."""
    from megatron_calibclip.checkpoint import CheckpointError, CheckpointManager
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel

    cfg = get_preset("tiny")
    with model_parallel():
        model, ddp, opt = build_trainable(cfg, seed=0, distributed=True)
        _steps(cfg, ddp, opt, _batches(cfg, 2))
        saved = _weights(model, cfg)
        CheckpointManager(root).save(2, ddp, opt)  # the default: dp_reshardable
    with model_parallel(tp=2):  # TP moves: the optimizer state cannot follow
        model, ddp, opt = build_trainable(cfg, seed=7, distributed=True)
        try:
            CheckpointManager(root).load_latest(ddp, opt)
            refusal = None
        except CheckpointError as err:
            refusal = str(err)
        loaded = CheckpointManager(root).load_latest(ddp)  # the weights alone reshard
        return refusal, loaded.step, saved, _weights(model, cfg)


def test_dp_reshardable_optimizer_state_refuses_another_tp_in_one_line(dist_pool, tmp_path):
    results = dist_pool(2).run(_tp_change_body, str(tmp_path / "ckpt"))
    for refusal, step, saved, loaded in results:
        assert refusal is not None and "\n" not in refusal
        assert "dp_reshardable" in refusal and "(1 x 1), not 2 x 1" in refusal, refusal
        assert "model.load" in refusal and "fully_reshardable" in refusal
        assert step == 2
        for name, value in saved.items():
            assert np.array_equal(value, loaded[name]), name
