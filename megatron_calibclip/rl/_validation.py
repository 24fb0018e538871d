"""Input checks shared by the rl/ functions.

Why a module of its own: every public function takes the same kind of [batch, seq]
tensors + bool mask, and a silent broadcast or a NaN hidden under padding is the most
common way an RL loss goes wrong without crashing. Each check raises ValueError with
the offending argument's name, so the trainer's error tells the user what to fix.

The value checks (NaN, empty mask, bound order) read tensor values and therefore
synchronise with the device; callers that already validated upstream can skip them
with ``validate=False`` on the public functions.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_mask(mask: object, shape: torch.Size, *, name: str = "mask") -> Tensor:
    mask = check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    return mask


def check_same_shape(name: str, x: object, shape: torch.Size, ref_name: str) -> Tensor:
    x = check_tensor(name, x)
    if x.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (the shape of {ref_name})"
        )
    return x


def check_token_shape(name: str, x: object) -> Tensor:
    """A per-token tensor must be 1-D [seq] or 2-D [batch, seq]."""
    x = check_tensor(name, x)
    if x.dim() not in (1, 2):
        raise ValueError(f"{name} must be 1-D [seq] or 2-D [batch, seq], got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
    return x


def check_nonempty_mask(mask: Tensor, *, name: str = "mask") -> None:
    if not bool(mask.any()):
        raise ValueError(f"{name} has no valid (True) position: nothing to compute a loss on")


def check_finite_where(name: str, x: Tensor, mask: Tensor) -> None:
    """NaN/inf are allowed under padding (mask False) but never at a valid position."""
    bad = mask & ~torch.isfinite(x)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) at unmasked positions "
            f"(first at index {idx}: {x[idx].item()})"
        )


def as_float(name: str, value: float | Tensor) -> float:
    """A scalar bound given as float or 0-d tensor, as a Python float (for checks only)."""
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a float or a 0-d tensor, got shape {tuple(value.shape)}")
        return float(value.detach().item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float or a 0-d tensor, got {type(value).__name__}")
    return float(value)


def check_positive(name: str, value: float, *, allow_inf: bool = False) -> None:
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a positive finite number, got {value}")


def check_choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """Loss math runs in at least float32: bf16 log-probs lose the ratio's small deviations."""
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype
