"""The real trainer (trainer/loop.py) with TrainerCheckpointer: a run stopped after step k and
resumed in a new `train` call reproduces the uninterrupted run's metrics (losses, rewards,
clip bounds) and final weights exactly."""
from __future__ import annotations

import numpy as np
import pytest

from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

CFG = merge(TINY_TRAIN, {"run": {"tensorboard": False, "plot": False}, "warmup": {"steps": 2}})


def _body(rank, world_size, out_dir, k, params_dtype, distributed=False):
    from megatron_calibclip.checkpoint.trainer_seam import TrainerCheckpointer
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train
    from tests.dist_utils import full_state

    captured = {}

    class Capturing(TrainerCheckpointer):  # also keeps the final weights for the comparison
        def save(self, step, components):
            super().save(step, components)
            cfg = components.model_cfg
            captured[step] = {
                "policy": full_state(components.policy, cfg.num_layers, cfg.vocab_size, False),
                "reference": full_state(components.reference, cfg.num_layers, cfg.vocab_size,
                                        False)}

    base = merge(CFG, {"model": {"params_dtype": params_dtype},
                       "optimizer": {"distributed": distributed}})
    straight_cfg = merge(base, {"run": {"name": "straight", "output_dir": out_dir}})
    straight = train(from_dict(TrainConfig, straight_cfg),
                     checkpointer=Capturing(f"{out_dir}/straight-ckpt"))["records"]
    final = captured.pop(CFG["run"]["steps"] - 1)
    resumed_cfg = merge(base, {"run": {"name": "resumed", "output_dir": out_dir}})
    ckpt = f"{out_dir}/resumed-ckpt"
    first = train(from_dict(TrainConfig, merge(resumed_cfg, {"run": {"steps": k}})),
                  checkpointer=Capturing(ckpt))["records"]
    second = train(from_dict(TrainConfig, resumed_cfg), checkpointer=Capturing(ckpt))["records"]
    return straight, first, second, final, captured[CFG["run"]["steps"] - 1]


def _numbers(record):
    """Everything but timings; NaN (a calibration fallback) compares equal to NaN."""
    return {key: "nan" if isinstance(value, float) and value != value else value
            for key, value in record.items() if not key.startswith("time/")}


# bf16: megatron's fp32 main params; distributed: its distributed optimizer, checkpointed
# dp_reshardable (the default, issue 37 finding 6), as the H100 recipes run
@pytest.mark.parametrize("params_dtype, distributed", [("fp32", False), ("bf16", False),
                                                       ("bf16", True)],
                         ids=["fp32", "bf16", "bf16-distributed-optimizer"])
def test_trainer_resume_matches_uninterrupted_run(dist_pool, tmp_path, params_dtype, distributed):
    k, n = 2, CFG["run"]["steps"]
    results = dist_pool(2).run(_body, str(tmp_path), k, params_dtype, distributed, timeout=600)
    for straight, first, second, final_straight, final_resumed in results:
        assert [r["step"] for r in second] == list(range(k, n))
        assert [_numbers(r) for r in first + second] == [_numbers(r) for r in straight]
        assert any("clip/lower" in r for r in second)
        for part in ("policy", "reference"):
            for name, value in final_straight[part].items():
                assert np.array_equal(value, final_resumed[part][name]), f"{part} {name}"


def _startup_signal_body(rank, world_size, out_dir):
    """SIGUSR1 on rank 1 while the components are being built (start-up, before warm-up)."""
    import os
    import signal

    import megatron_calibclip.trainer.loop as loop
    from megatron_calibclip.checkpoint import EXIT_PREEMPTED
    from megatron_calibclip.checkpoint.info import CheckpointInfo
    from megatron_calibclip.checkpoint.trainer_seam import TrainerCheckpointer
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train

    def cfg(name):
        return from_dict(TrainConfig, merge(CFG, {"run": {"name": name, "output_dir": out_dir}}))

    straight = train(cfg("straight"), checkpointer=TrainerCheckpointer(f"{out_dir}/s-ckpt"))

    build = loop.build_components

    def build_then_signal(*args, **kwargs):
        components = build(*args, **kwargs)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return components

    ckpt = f"{out_dir}/p-ckpt"
    loop.build_components = build_then_signal
    try:
        train(cfg("preempted"), checkpointer=TrainerCheckpointer(ckpt))
        code = None
    except SystemExit as exit_:
        code = exit_.code
    finally:
        loop.build_components = build
    info = CheckpointInfo.read(f"{ckpt}/step_00000000")
    resumed = train(cfg("preempted"), checkpointer=TrainerCheckpointer(ckpt))
    return (code == EXIT_PREEMPTED, info.step, list(info.contents), straight["records"],
            resumed["records"])


def test_signal_during_startup_saves_the_warmup_and_resumes_identically(dist_pool, tmp_path):
    """A SLURM signal during start-up (model build, warm-up, load) must end in exit 75 on
    every rank with the warm-up saved, and the requeued attempt must match an uninterrupted
    run exactly (it skips the warm-up and trains every step)."""
    results = dist_pool(2).run(_startup_signal_body, str(tmp_path), timeout=600)
    for exited_75, step, contents, straight, resumed in results:
        assert exited_75, "both ranks exit with EXIT_PREEMPTED (only rank 1 was signalled)"
        assert step == 0 and "frozen:reference" in contents, contents
        assert [r["step"] for r in resumed] == list(range(CFG["run"]["steps"]))
        assert [_numbers(r) for r in resumed] == [_numbers(r) for r in straight]
