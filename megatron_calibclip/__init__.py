"""megatron-calibclip: stable full-pipeline FP8 RL (GRPO/DAPO) with Calibrated Clipping."""
import warnings as _warnings

__version__ = "0.1.0"

# megatron-core announces its pure-torch fallbacks at import time on every machine without
# Transformer Engine / Apex (all CPU runs). They are expected there, so they are silenced by
# exact message; every other warning is left alone.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed. Falling back to Torch Norm",
    "When using async grad allreduce it is recommended",
    "full scope is deprecated",
):
    _warnings.filterwarnings("ignore", message=_message, category=UserWarning)
# torch 2.13 deprecates the collective that megatron-core 0.16 gathers TP shards with; one
# warning per rank per run that no user of this package can act on.
_warnings.filterwarnings(
    "ignore", message="`torch.distributed.all_gather_into_tensor` is deprecated",
    category=FutureWarning)


class _DropCudaHomeGuess:
    """The CUDA build of torch (our Python 3.12 leg, docs/versions.md) on a machine with nvcc
    but no GPU logs "No CUDA runtime is found, using CUDA_HOME=..." when megatron-core imports
    torch.utils.cpp_extension: one stderr line per process that breaks every one-line error
    and that no user can act on (no kernel is built). Only that message is dropped."""

    @staticmethod
    def filter(record) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


import logging as _logging  # noqa: E402

_logging.getLogger("torch.utils.cpp_extension").addFilter(_DropCudaHomeGuess())
