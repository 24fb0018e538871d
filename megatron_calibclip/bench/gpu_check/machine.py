"""What the check ran on: versions, the device, and which FP8 backend `auto` resolves to."""
from __future__ import annotations

import importlib.util
import platform

import torch


def _scaling_types() -> list[str]:
    import torch.nn.functional as F

    scaling = getattr(F, "ScalingType", None)
    if scaling is None:
        return []
    return sorted(name for name in dir(scaling) if not name.startswith("_") and name[0].isupper())


def machine_facts(device: str) -> dict:
    from megatron.core import __version__ as mcore_version

    from megatron_calibclip.fp8.backend import resolve_backend

    backend, why = resolve_backend("auto")
    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "megatron_core": mcore_version,
        "transformer_engine_installed": importlib.util.find_spec("transformer_engine") is not None,
        "device": device,
        "fp8_backend_auto": {"backend": backend, "why": why},
        "has_torch_scaled_mm": hasattr(torch, "_scaled_mm"),
        "F_scaled_mm_scaling_types": _scaling_types(),
    }
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name()
        facts["compute_capability"] = list(torch.cuda.get_device_capability())
        facts["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return facts
