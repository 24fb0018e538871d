"""How the sharded part of a checkpoint is written: megatron's torch_dist format, always.

Why a strategy of our own: megatron-core 0.16.1's default torch_dist writer
(`FileSystemWriterAsync`) cannot run without CUDA or inside daemonic processes:
  * filesystem_async.py `FileSystemWriterAsync.preload_tensors` calls torch.cuda.synchronize();
  * state_dict_saver.py `save_state_dict_async_finalize` allocates on torch.cuda.current_device();
  * filesystem_async.py `_get_write_results_queue` starts a multiprocessing Manager (spawn) and
    `write_preloaded_data_multiproc` forks writer processes (impossible in daemonic workers).
`SyncTorchDistSaveStrategy` keeps megatron's translation of ShardedTensors/ShardedObjects and
its save planner, and hands the result to torch.distributed.checkpoint's synchronous
FileSystemWriter in this process. The files are the same torch_dist format (metadata.json says
'torch_dist', version 1) and are read by megatron's unmodified TorchDistLoadShardedStrategy.
Typed by TorchDistSaveShardedStrategy, not the abstract base: 0.19 removed
`strategies.base.SaveShardedStrategy` and accepts only that class (serialization.save).
With CUDA, "auto" keeps megatron's own (faster, parallel) writer. This is a strategy object
passed to `dist_checkpointing.save`, not a patch: megatron-core itself is left unchanged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)

StrategyName = Literal["auto", "sync", "megatron"]


class SyncTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist checkpoints written synchronously by this process (CPU/gloo-safe)."""

    def __init__(self) -> None:
        super().__init__("torch_dist", 1)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        dcp.save(
            pyt_state_dict,
            storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1,
                                                sync_files=True),
            planner=MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica,
                flatten_state_dict=False,
            ),
        )


def save_strategy(name: StrategyName = "auto") -> Optional[TorchDistSaveShardedStrategy]:
    """The strategy for `dist_checkpointing.save` (None = megatron's default torch_dist writer).

    "auto": megatron's writer with CUDA, ours without; "sync": always ours; "megatron": always
    megatron's.
    """
    if name == "auto":
        name = "megatron" if torch.cuda.is_available() else "sync"
    if name == "megatron":
        return None
    if name == "sync":
        return SyncTorchDistSaveStrategy()
    raise ValueError(f"save strategy {name!r} is not one of ['auto', 'sync', 'megatron']")
