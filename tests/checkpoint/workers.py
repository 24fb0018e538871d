"""Processes that the crash and preemption tests start and then kill or signal.

    python -m tests.checkpoint.workers crash ROOT READY_FILE
    python -m tests.checkpoint.workers preempt ROOT PROGRESS_DIR      (torchrun-style env)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def crash(root: str, ready_file: str) -> None:
    """Save step 1; start saving step 2 and hang after the shards are written (parent kills)."""
    from megatron_calibclip.checkpoint import CheckpointManager, strategy
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import ParallelLayout, initialize_distributed

    initialize_distributed(ParallelLayout())
    model = build_policy_model(get_preset("tiny"), seed=0)
    manager = CheckpointManager(root)
    manager.save(1, model, extra_state={"tag": "one"})

    original = strategy.SyncTorchDistSaveStrategy.save

    def save_then_hang(self, sharded_state_dict, checkpoint_dir):
        original(self, sharded_state_dict, checkpoint_dir)
        Path(ready_file).write_text(str(checkpoint_dir))
        time.sleep(600)

    strategy.SyncTorchDistSaveStrategy.save = save_then_hang
    with __import__("torch").no_grad():
        for p in model.parameters():
            p.add_(1.0)
    manager.save(2, model, extra_state={"tag": "two"})
    sys.exit(3)  # never reached


def preempt(root: str, progress_dir: str) -> None:
    """A fake training loop on 2 ranks that stops, saves and exits EXIT_PREEMPTED (75) when signalled."""
    import torch
    import torch.distributed as dist

    from megatron_calibclip.checkpoint import EXIT_PREEMPTED, CheckpointManager, PreemptionHandler
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import ParallelLayout, initialize_distributed

    env = initialize_distributed(ParallelLayout())  # TP=1, PP=1, DP=2
    model = build_policy_model(get_preset("tiny"), seed=0)
    manager = CheckpointManager(root)
    progress = Path(progress_dir)
    with PreemptionHandler() as handler:
        for step in range(100_000):
            work = torch.ones(1)
            dist.all_reduce(work)  # the "step"
            time.sleep(0.02 * (1 + env.rank))  # ranks at different speeds
            (progress / f"rank{env.rank}.step").write_text(str(step))
            if handler.should_stop():
                manager.save(step + 1, model, extra_state={"stopped_after": step})
                (progress / f"rank{env.rank}.done").write_text(
                    f"{step} {handler.received or 0}")
                sys.exit(EXIT_PREEMPTED)
    sys.exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"crash": crash, "preempt": preempt}[sys.argv[1]](*sys.argv[2:])
