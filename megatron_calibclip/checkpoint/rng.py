"""Every random number generator a training step can draw from, captured and restored.

Why all of them: a resumed run is bit-identical to an uninterrupted one only if sampling,
dropout-like noise, data shuffles and megatron's model-parallel RNG tracker all continue
from where they were. Each rank has its own states, so they are saved per rank.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (CPU and, with CUDA, the current device) and megatron's tracker."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() if torch.is_tensor(v) else v
                    for k, v in _tracker().get_states().items()},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state (on the same kind of device)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        _tracker().set_states(state["tracker"])
