"""The two ways checkpoint code fails, each with a message that names the path or tensor.

Why separate types: the CLI turns these into a one-line error and exit status 2, while any
other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded (missing, incomplete, incompatible)."""


class ConversionError(ValueError):
    """Input for a conversion is invalid: unknown architecture, missing/extra tensor, wrong
    shape, truncated file, or an output folder that already exists."""


class DamagedCheckpointError(CheckpointError):
    """A committed checkpoint folder has a missing, truncated or unreadable file (named)."""
