"""The one place where megatron-core's supported lines differ (docs/versions.md).

We support two lines, each tested by its own CI leg: 0.16.x on Python 3.11 and 0.19.x on
Python 3.12 (0.17+ wheels need Python >= 3.12). Code that must behave differently on them
asks this module, never `megatron.core.__version__` itself, so that every difference is
listed here, named, and removable when a line is dropped.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from typing import Any

# line -> the Python it is tested on (a CI leg each: `make test`, `make test-py312`)
SUPPORTED_LINES: dict[str, str] = {"0.16": "Python 3.11", "0.19": "Python 3.12"}


def megatron_version() -> str:
    """The installed megatron-core's version (from its metadata; megatron is not imported)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def megatron_line(version: str | None = None) -> str:
    """'0.19' for '0.19.2'."""
    return ".".join((version or megatron_version()).split(".")[:2])


def at_least(line: str, version: str | None = None) -> bool:
    """True when the installed (or given) megatron-core is on `line` or a later one."""
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split(".")[:2])
    return key(megatron_line(version)) >= key(line)


def supported_lines_text() -> str:
    """'0.16.x (Python 3.11), 0.19.x (Python 3.12)' for `calibclip info` and errors."""
    return ", ".join(f"{line}.x ({py})" for line, py in SUPPORTED_LINES.items())


def line_status(version: str | None = None) -> str:
    """'tested' for a supported line, else why not (printed by `calibclip info`)."""
    line = megatron_line(version)
    if line in SUPPORTED_LINES:
        return "tested"
    return f"untested line {line} (supported: {supported_lines_text()})"


def mlp_submodules(layer_spec: Any) -> Any:
    """The MLPSubmodules (linear_fc1, linear_fc2) of a dense decoder layer spec, to swap its
    linear classes in place.

    0.16: `layer_spec.submodules.mlp` is a ModuleSpec(module=MLP, submodules=MLPSubmodules).
    0.19: it is `functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))`
    (gpt_layer_specs.get_mlp_module_spec_for_backend). Decided by structure, so a spec of
    either form works under either release.
    """
    mlp = layer_spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        return mlp.keywords["submodules"]
    return mlp.submodules


def checkpoint_refusal(written_by: str, installed: str | None = None) -> str | None:
    """Why a dist checkpoint written under megatron-core `written_by` cannot be loaded under
    the installed release, or None when it can.

    0.19's dist_checkpointing saves the common state as a sharded object inside the .distcp
    files (serialization.save: "common_state") and writes no common.pt; 0.16's loader reads
    common.pt, so it cannot read a 0.19 checkpoint (measured: AttributeError deep in the load).
    0.19 reads 0.16 checkpoints (tests/checkpoint/test_cross_version.py resumes one exactly).
    """
    installed = installed or megatron_version()
    if not written_by or at_least("0.19", installed) or not at_least("0.19", written_by):
        return None
    return (f"it was written by megatron-core {written_by}, which keeps the common state inside "
            f"the sharded files (no common.pt); megatron-core {installed} cannot read that: "
            f"resume it under 0.19.x, or take its weights across with `calibclip convert "
            f"mcore-to-hf` under 0.19 and `hf-to-mcore` here (the optimizer state stays behind)")


def inference_mode() -> Any:
    """The context under which megatron's GPTModel takes its inference paths (KV cache,
    last-token-only logits) for a forward with an inference context.

    0.16: a forward is an inference forward when `inference_context is not None and not
    model.training`; no flag exists. 0.19: the process-wide flag
    `megatron.core.inference.utils.InferenceMode` decides (gpt_model._postprocess: without
    it the prefill materialises b x prompt x V logits). Decided by whether the flag exists.
    """
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(InferenceMode, "active"):
        return contextlib.nullcontext()
    return InferenceMode.active()
