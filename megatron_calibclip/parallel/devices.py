"""Where a new tensor must live: the model's device, the collective backend's, or the host.

Why: a tensor created without `device=` lands on the CPU. On a CPU run that is the right
device by accident; on a GPU run it is a batch that the model cannot read, a sampling
generator that `torch.multinomial` rejects, or a payload that NCCL refuses. So every tensor
the package creates names its device through one of these three answers (tests/
strict_device.py checks that none is left implicit, see docs/devices.md).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

# Tensors that stay on the host on purpose: seeded generators whose draws must be the same
# on every machine (weight init, tie dithering, probe data), file contents, query tables.
HOST = torch.device("cpu")


# The CPU run's stand-in for an accelerator: the host, except in the device-placement test
# (tests/trainer/test_device_placement.py), which builds the trainer for the meta device.
_CPU_STAND_IN = [HOST]


def compute_device() -> torch.device:
    """Where the trainer puts its models right after building them (Megatron-LM's get_model:
    `model.cuda(torch.cuda.current_device())`): the current CUDA device, else the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU_STAND_IN[0]


@contextlib.contextmanager
def cpu_stand_in(device: torch.device) -> Iterator[None]:
    """Inside: a CPU run builds for `device` (and megatron's CUDA allocations follow it, with
    the CPU patches' accelerator_stand_in). Test-only: the meta device proves placement."""
    from megatron_calibclip.patches import accelerator_stand_in

    previous = _CPU_STAND_IN[0]
    _CPU_STAND_IN[0] = torch.device(device)
    try:
        with accelerator_stand_in(device):
            yield
    finally:
        _CPU_STAND_IN[0] = previous


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (compute tensors for it go there)."""
    for p in model.parameters():
        return p.device
    raise ValueError(f"{type(model).__name__} has no parameters: its device is unknown")


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a collective over `group` needs: the current CUDA device under NCCL, else
    the host (gloo); the host when torch.distributed is not running."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return HOST


def device_of(value: Any, default: torch.device = HOST) -> torch.device:
    """A tensor's own device, or `default` for Python numbers and lists."""
    return value.device if isinstance(value, torch.Tensor) else default
