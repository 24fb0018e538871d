"""Transformer Engine's `_extra_state`: the one kind of key a checkpoint may lack at load.

Why: TE modules keep their FP8 metadata as an `_extra_state` that other specs do not have. A
checkpoint written by the local spec (the converter, which runs with GPUs hidden) has none for
the norms TE's spec makes TENorm, so megatron's load asks for ShardedObjects the checkpoint
lacks; and megatron never saves TEDotProductAttention's, so a strict `load_state_dict` sees it
missing unless TE's own (temporary) post-hook drops it. Megatron-LM's loader relaxes strictness
for these; we do it for exactly these keys, name them, and let every other absent or surplus key
fail as before (docs/gpu.md).
"""
from __future__ import annotations

from typing import Iterable

import torch

from megatron_calibclip.checkpoint.errors import CheckpointError

EXTRA_STATE_SUFFIX = "_extra_state"


def is_extra_state(key: str) -> bool:
    """A module state key or a sharded checkpoint key (`<key>/shard_...`) of an extra state."""
    return key.split("/", 1)[0].endswith(EXTRA_STATE_SUFFIX)


def _shown(keys: Iterable[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def check_absent_from_checkpoint(folder, absent: Iterable[str]) -> list[str]:
    """Keys the load asked for that `folder` lacks: extra states are returned (tolerated), any
    other key raises CheckpointError naming it (never a silently unloaded tensor)."""
    absent = sorted(set(absent))
    others = [k for k in absent if not is_extra_state(k)]
    if others:
        raise CheckpointError(f"{folder} holds no {_shown(others)} (written by another "
                              f"architecture or layer spec?)")
    return absent


def load_module_state(module: torch.nn.Module, state: dict, what: str) -> list[str]:
    """`module.load_state_dict(state)` that tolerates only missing extra states (returned);
    any other missing key, or any unexpected one, raises CheckpointError naming them."""
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not is_extra_state(k)]
    if missing or result.unexpected_keys:
        parts = ([f"missing {_shown(missing)}"] if missing else []) + (
            [f"unexpected {_shown(result.unexpected_keys)}"] if result.unexpected_keys else [])
        raise CheckpointError(f"cannot load {what}: {'; '.join(parts)}")
    return sorted(result.missing_keys)
