"""CPU (gloo) support for megatron-core (each release in patches/releases/), applied at run time and only without CUDA.

Installed as ``megatron_calibclip.patches`` (see setup.py). Read patches/README.md first.

megatron-core assumes CUDA at a handful of call sites (NOTES-platform.md lists them):
``torch.cuda.current_device()`` as an allocation device, ``torch.cuda.synchronize()``,
``device="cuda"`` literals, the CUDA RNG state tracker, and one ``weight.data.cuda()``.
Rather than copying and editing megatron functions (a fork in disguise), we change *what
the name ``torch`` means inside the affected megatron modules*: their module global
``torch`` is replaced by a proxy that forwards everything to the real torch, except

* ``torch.cuda`` -> a CPU shim (current_device() is the CPU device, synchronize() is a
  no-op, the "CUDA" RNG state is the CPU generator's state);
* tensor factories (empty/zeros/ones/full/tensor/arange/...) map ``device="cuda"`` to CPU.

Two module functions of the RNG tracker (``_get_cuda_rng_state``/``_set_cuda_rng_state``)
are replaced by CPU versions, and ``LanguageModule.setup_embeddings_and_output_layer``
runs with ``Tensor.cuda`` as identity (tied embeddings under PP).

Nothing is applied when CUDA is available: on GPU megatron-core runs unmodified.
Every megatron function whose CUDA call sites we rely on is listed and fingerprinted in
sites.py (read by fingerprint.py); tests/test_patches.py fails loudly if the installed
megatron-core differs.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import types
import warnings
from typing import Any, Iterator

import torch

from .fingerprint import cuda_sites, source_fingerprint
from .sites import FINGERPRINTS, MADE_FOR_MEGATRON_CORE, PROXIED_MODULES, REPLACED_FUNCTIONS, all_patched_sites

__all__ = [
    "FINGERPRINTS", "MADE_FOR_MEGATRON_CORE", "PROXIED_MODULES", "REPLACED_FUNCTIONS", "all_patched_sites",
    "accelerator_stand_in", "apply_cpu_patches", "cpu_patches_applied", "cpu_patches_needed", "cuda_sites", "source_fingerprint",
]

_CPU = torch.device("cpu")
# The device megatron's `torch.cuda` stands for inside the proxied modules: the CPU, except
# in the device-placement test, which builds the trainer for the meta device
# (`accelerator_stand_in`) to prove that nothing stays behind on the host.
_STAND_IN = [_CPU]
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor",
)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _CudaShim:
    """Stands in for ``torch.cuda`` inside the proxied megatron modules (CPU only)."""

    def current_device(self) -> torch.device:
        return _STAND_IN[0]

    def synchronize(self, *args: Any, **kwargs: Any) -> None:
        return None

    def is_available(self) -> bool:
        return False

    def device_count(self) -> int:
        return 0

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def current_stream(self, device: Any = None) -> Any:
        """torch.cpu's stream: its wait_event/wait_stream are no-ops, as work on the CPU is in
        order (0.19's grad sync calls torch.cuda.current_stream() unconditionally)."""
        return torch.cpu.current_stream()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchProxy(types.ModuleType):
    """The real torch, seen through a CPU lens: `cuda` is a shim, factories ignore 'cuda'."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaShim()
        for name in _FACTORIES:
            setattr(self, name, self._cpu_factory(getattr(torch, name)))

    @staticmethod
    def _cpu_factory(fn):
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = _STAND_IN[0]
            return fn(*args, **kwargs)

        return wrapper

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """CPU replacement of megatron's _get_cuda_rng_state: the CPU generator plays the GPU's."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    """CPU replacement of megatron's _set_cuda_rng_state."""
    torch.set_rng_state(new_state)


def _with_tensor_method(fn, name: str, make_replacement):
    """Wrap `fn` so that it runs with `torch.Tensor.<name>` replaced (restored afterwards).

    make_replacement(original) -> the temporary method. Scoped to the call: code outside
    `fn` never sees the replacement.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, make_replacement(original))
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(torch.Tensor, name, original)

    wrapper.__calibclip_patched__ = True  # type: ignore[attr-defined]
    return wrapper


def _cuda_is_identity(method):
    """Run `method` with Tensor.cuda() returning the tensor itself (CPU only)."""
    return _with_tensor_method(method, "cuda", lambda original: lambda self, *a, **k: self)


def _cpu_reports_cuda_type(fn):
    """Run `fn` with `Tensor.type()` naming CPU tensors as CUDA ones ('torch.cuda.FloatTensor').

    megatron's optimizers assert or branch on the type *name* of fp32 tensors; the check is
    about the dtype, which is the same on CPU. Only the no-argument form is changed.
    """

    def make(original):
        def type_name(self, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw:
                name = original(self)
                kind = self.device.type
                if (kind in ("cpu", _STAND_IN[0].type) and name.startswith("torch.")
                        and ".cuda." not in name):  # (nested calls see the name already changed)
                    base = name[len("torch."):]
                    if base.startswith(f"{kind}."):  # "torch.meta.FloatTensor" (the stand-in)
                        base = base[len(kind) + 1:]
                    return "torch.cuda." + base
                return name
            return original(self, dtype, non_blocking, **kw)

        return type_name

    return _with_tensor_method(fn, "type", make)


@contextlib.contextmanager
def accelerator_stand_in(device: torch.device) -> Iterator[None]:
    """Inside: megatron's CUDA allocations (grad buffers, loss scales, ...) land on `device`
    instead of the CPU. For the device-placement test (meta device), never for a run."""
    previous = _STAND_IN[0]
    _STAND_IN[0] = torch.device(device)
    try:
        yield
    finally:
        _STAND_IN[0] = previous


_APPLIED = False


def cpu_patches_needed() -> bool:
    return not torch.cuda.is_available()


def cpu_patches_applied() -> bool:
    return _APPLIED


def apply_cpu_patches(force: bool = False) -> bool:
    """Make megatron-core's local spec run on CPU/gloo. No-op (returns False) with CUDA.

    Idempotent. `force=True` is for tests only and is refused when CUDA is available.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if torch.cuda.is_available():
        if force:
            raise RuntimeError("refusing to apply CPU patches to megatron-core with CUDA present")
        return False
    import megatron.core

    from .sites import installed_release

    version = installed_release()  # metadata: 0.19's __version__ may carry "+<git sha>"
    if version != MADE_FOR_MEGATRON_CORE:
        warnings.warn(
            f"megatron_calibclip.patches were made for megatron-core {MADE_FOR_MEGATRON_CORE}, "
            f"found {version}; run tests/test_patches.py to check them",
            RuntimeWarning,
            stacklevel=2,
        )
    proxy = _TorchProxy()
    for module_name in PROXIED_MODULES:
        module = importlib.import_module(module_name)
        if getattr(module, "torch", None) is not torch and not isinstance(
            getattr(module, "torch", None), _TorchProxy
        ):
            raise RuntimeError(f"{module_name} has no global 'torch' to patch")
        module.torch = proxy

    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    random_mod._get_cuda_rng_state = _get_cpu_rng_state
    random_mod._set_cuda_rng_state = _set_cpu_rng_state

    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer_mod = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if not getattr(clip_grads.clip_grad_by_total_norm_fp32, "__calibclip_patched__", False):
        wrapped = _cpu_reports_cuda_type(clip_grads.clip_grad_by_total_norm_fp32)
        clip_grads.clip_grad_by_total_norm_fp32 = wrapped
        optimizer_mod.clip_grad_by_total_norm_fp32 = wrapped  # imported there by name
    build = distrib.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]
    if not getattr(build.__func__, "__calibclip_patched__", False):
        distrib.DistributedOptimizer._build_model_and_main_param_groups = classmethod(
            _cpu_reports_cuda_type(build.__func__))
    f16 = optimizer_mod.Float16OptimizerWithFloat16Params
    if not getattr(f16.__init__, "__calibclip_patched__", False):
        f16.__init__ = _cpu_reports_cuda_type(f16.__init__)

    from megatron.core.models.common.language_module.language_module import LanguageModule

    method = LanguageModule.setup_embeddings_and_output_layer
    if not getattr(method, "__calibclip_patched__", False):
        LanguageModule.setup_embeddings_and_output_layer = _cuda_is_identity(method)
    _APPLIED = True
    return True
