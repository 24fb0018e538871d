"""Strict device: on the CPU, catch the tensors the package creates without naming a device.

Why: in CPU CI the model lives on the CPU, so `torch.zeros(n)` lands on the right device by
accident and the first GPU run is the first to fail. Inside `strict_device()` every tensor
factory (torch.zeros/ones/empty/full/arange/tensor/as_tensor/rand*/randperm/linspace/...,
torch.from_numpy, torch.normal with number arguments) and every `torch.Generator(...)`
called directly from a frame of `megatron_calibclip` without a `device=` (or with
`device=None`) is recorded with its file and line. Calls made by torch, megatron-core or the
tests are not ours to fix and are ignored, as are `tensor`/`as_tensor` of a tensor (they keep
its device) and `*_like`/`new_*` (they inherit one).

It sees only code that runs; it cannot tell a wrong explicit device from a right one (both
are `cpu` here), nor NCCL rules, CUDA streams or a CPU/CUDA generator mismatch: see
docs/devices.md.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import megatron_calibclip

PACKAGE_DIR = os.path.realpath(os.path.dirname(megatron_calibclip.__file__)) + os.sep
_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
_THIS_FILE = os.path.realpath(__file__)

FACTORIES = frozenset(_device_constructors()) | {torch.from_numpy, torch.normal}
# these take their device from a tensor argument when they are given one
_INHERIT_FROM_TENSOR = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.normal})


class StrictDeviceError(AssertionError):
    """Tensors were created in megatron_calibclip without an explicit device."""


@dataclass
class DeviceReport:
    """The sites seen creating a tensor or a generator without a device, in call order."""

    violations: list[str] = field(default_factory=list)

    def record(self, what: str) -> None:
        site = _package_caller()
        if site is not None:
            self.violations.append(f"{site}: {what} without device=")

    @property
    def sites(self) -> list[str]:
        """Each violating site once, in the order first seen."""
        return list(dict.fromkeys(self.violations))


def _package_caller() -> str | None:
    """'megatron_calibclip/x.py:12 (fn)' if the first frame outside torch and this module is
    inside the package, else None."""
    frame = sys._getframe(2)
    while frame is not None:
        name = _real(frame.f_code.co_filename)
        if not (name.startswith(_TORCH_DIR) or name == _THIS_FILE):
            break
        frame = frame.f_back
    if frame is None or not _real(frame.f_code.co_filename).startswith(PACKAGE_DIR):
        return None
    rel = os.path.relpath(_real(frame.f_code.co_filename), os.path.dirname(PACKAGE_DIR[:-1]))
    return f"{rel}:{frame.f_lineno} ({frame.f_code.co_name})"


@functools.lru_cache(maxsize=None)
def _real(filename: str) -> str:
    return os.path.realpath(filename)


class _FactoryWatch(TorchFunctionMode):
    def __init__(self, report: DeviceReport) -> None:
        super().__init__()
        self.report = report

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            inherits = func in _INHERIT_FROM_TENSOR and any(
                isinstance(a, torch.Tensor) for a in args[:2])
            if not inherits:
                self.report.record(f"torch.{func.__name__}")
        return func(*args, **kwargs)


def _checked_generator_class(report: DeviceReport) -> type:
    real = torch.Generator

    class CheckedGenerator(real):  # type: ignore[misc, valid-type]
        def __new__(cls, device=None):
            if device is None:
                report.record("torch.Generator")
                return real.__new__(cls)
            return real.__new__(cls, device)

    return CheckedGenerator


@contextlib.contextmanager
def strict_device(raise_on_exit: bool = True) -> Iterator[DeviceReport]:
    """Record implicit-device tensor creation by the package; raise at exit if any (or not,
    with raise_on_exit=False: the caller then reads `report.sites`)."""
    report = DeviceReport()
    real_generator = torch.Generator
    torch.Generator = _checked_generator_class(report)
    try:
        with _FactoryWatch(report):
            yield report
    finally:
        torch.Generator = real_generator
    if raise_on_exit and report.violations:
        raise StrictDeviceError("tensors created without a device:\n  " + "\n  ".join(report.sites))
