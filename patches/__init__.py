"""CPU (gloo) support for megatron-core 0.16.1, applied at run time and only without CUDA.

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
Every megatron function whose CUDA call sites we rely on is fingerprinted below;
tests/test_patches.py fails loudly if the installed megatron-core differs.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.util
import types
import warnings
from typing import Any

import torch

MADE_FOR_MEGATRON_CORE = "0.16.1"

# Modules whose global name `torch` is replaced by the proxy, and in each the functions
# (qualified names) holding the CUDA-only call sites. These are the fingerprinted sites.
PROXIED_MODULES: dict[str, list[str]] = {
    "megatron.core.tensor_parallel.random": [
        "_get_cuda_rng_state",
        "_set_cuda_rng_state",
        "CudaRNGStatesTracker.add",
        "model_parallel_cuda_manual_seed",
    ],
    "megatron.core.tensor_parallel.mappings": [
        "_gather_along_last_dim",
        "_gather_along_first_dim",
        "_reduce_scatter_along_first_dim",
        "_AllToAll.forward",
    ],
    "megatron.core.tensor_parallel.layers": [
        "VocabParallelEmbedding.__init__",
        "LinearWithGradAccumulationAndAsyncCommunication.backward",
        "ColumnParallelLinear.__init__",
        "RowParallelLinear.__init__",
    ],
    "megatron.core.utils": [
        "GlobalMemoryBuffer.get_tensor",
        # not on our code paths (symmetric memory, DP hash checks, multi-tensor l2 norm
        # fallback, straggler detector, hybrid CP); listed so that changes are noticed
        "GlobalSymmetricMemoryBuffer.__init__",
        "check_param_hashes_across_dp_replicas",
        "local_multi_tensor_l2_norm",
        "StragglerDetector.configure",
        "StragglerDetector.elapsed",
        "get_batch_on_this_hybrid_cp_rank",
    ],
    "megatron.core.models.common.embeddings.rotary_pos_embedding": [
        "RotaryEmbedding.__init__",
        "RotaryEmbedding.get_emb",
        "MultimodalRotaryEmbedding.__init__",
    ],
    "megatron.core.pipeline_parallel.p2p_communication": [
        "P2PCommunicator._communicate_shapes",
        "P2PCommunicator._communicate",
    ],
    "megatron.core.pipeline_parallel.schedules": [
        "forward_step",  # only torch.autocast("cuda") when config.enable_autocast (keep off)
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_with_interleaving",
        "forward_backward_pipelining_without_interleaving",
    ],
    "megatron.core.transformer.utils": [
        "get_default_causal_mask",
        "get_sliding_window_causal_mask",
    ],
    "megatron.core.optimizer.clip_grads": [
        "get_grad_norm_fp32",
        "clip_grad_by_total_norm_fp32",
        "count_zeros_fp32",
    ],
    "megatron.core.models.gpt.gpt_model": ["GPTModel._preprocess"],
    "megatron.core.transformer.attention": ["Attention._allocate_memory"],
    # megatron's optimizers (loss-scale tensors) and checkpoint helpers used by the trainer
    "megatron.core.optimizer.optimizer": [
        "MegatronOptimizer.restore_from_cpu",
        "MixedPrecisionOptimizer.__init__",
        "FP32Optimizer.__init__",
        "ChainedOptimizer.get_loss_scale",
    ],
    "megatron.core.optimizer.distrib_optimizer": [
        "DistributedOptimizer.load_state_dict",
        "DistributedOptimizer.get_parameter_state_dp_zero",
    ],
    # megatron's DDP (grad buffers, finalize_model_grads) used by the trainer
    # (communication streams are used only with overlap_grad_reduce, which stays off on CPU)
    "megatron.core.distributed.param_and_grad_buffer": ["_ParamAndGradBuffer.__init__"],
    "megatron.core.distributed.distributed_data_parallel": [
        "DistributedDataParallel.__init__",
        "DistributedDataParallel.offload_grad_buffers",
        "DistributedDataParallel.restore_grad_buffers",
    ],
}

# Functions replaced or wrapped outright.
REPLACED_FUNCTIONS = [
    # these compare `tensor.type()` with 'torch.cuda.FloatTensor'; they run with CPU tensors
    # reporting their CUDA type name (see _cpu_reports_cuda_type)
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.setup_embeddings_and_output_layer",
]

_CPU = torch.device("cpu")
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
        return _CPU

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
                kwargs["device"] = _CPU
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
                if self.device.type == "cpu" and name.startswith("torch.") and ".cuda." not in name:
                    return "torch.cuda." + name[len("torch."):]
                return name
            return original(self, dtype, non_blocking, **kw)

        return type_name

    return _with_tensor_method(fn, "type", make)


def _find_function(tree: ast.AST, qualname: str) -> ast.AST | None:
    node: Any = tree
    for part in qualname.split("."):
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name == part:
                    found = child
        if found is None:
            return None
        node = found
    return node


def source_fingerprint(site: str) -> str:
    """sha256 (first 16 hex) of a function's source text in the installed megatron-core.

    `site` is 'package.module:Qualified.name'. Read from the module's file with `ast`, so it
    is the same before and after the patches are applied.
    """
    module_name, _, qualname = site.partition(":")
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise LookupError(f"module {module_name} not found")
    text = open(spec.origin, encoding="utf-8").read()
    node = _find_function(ast.parse(text), qualname)
    if node is None:
        raise LookupError(f"{site}: function not found in {spec.origin}")
    segment = ast.get_source_segment(text, node) or ""
    return hashlib.sha256(segment.encode()).hexdigest()[:16]


def cuda_sites(module_name: str) -> list[str]:
    """Qualified names of the functions in a module that mention CUDA in code (not comments).

    A CUDA mention: an attribute `.cuda` / `torch.cuda.*` access or a "cuda" string constant.
    Used by the tests to notice new CUDA call sites in a changed megatron-core.
    """
    spec = importlib.util.find_spec(module_name)
    text = open(spec.origin, encoding="utf-8").read()
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                if _mentions_cuda(child):
                    found.append(name)

    visit(ast.parse(text), "")
    return found


def _mentions_cuda(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("current_device", "synchronize", "cuda", "manual_seed",
                                  "get_rng_state"):
                value = node.func.value
                if node.func.attr == "cuda" or (
                    isinstance(value, ast.Attribute) and value.attr == "cuda"
                ):
                    return True
        if isinstance(node, ast.Constant) and node.value == "cuda":
            parent_ok = True
            if parent_ok:
                return True
    return False


def all_patched_sites() -> list[str]:
    """Every megatron function whose source the patches rely on, as 'module:qualname'."""
    sites = [f"{m}:{f}" for m, fns in PROXIED_MODULES.items() for f in fns]
    return sites + list(REPLACED_FUNCTIONS)


# Fingerprints of the functions above in megatron-core 0.16.1 (tools/patch_fingerprints.py).
FINGERPRINTS: dict[str, str] = {
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": "0c2b8f05b864739e",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": "dea947ca0b7dc92b",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add": "c7b54631963881cc",
    "megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed": "8299b7e2c399ea2f",
    "megatron.core.tensor_parallel.mappings:_gather_along_last_dim": "afce19cdeb8f2473",
    "megatron.core.tensor_parallel.mappings:_gather_along_first_dim": "abaaf454b5e09149",
    "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim": "09ac896729369d2d",
    "megatron.core.tensor_parallel.mappings:_AllToAll.forward": "36aa19f1e31da17e",
    "megatron.core.tensor_parallel.layers:VocabParallelEmbedding.__init__": "67fa488ec48039a6",
    "megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward": "811da15f04b42d72",
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear.__init__": "7c3a8e3b79e9bbc2",
    "megatron.core.tensor_parallel.layers:RowParallelLinear.__init__": "5a23d4a1bd458e34",
    "megatron.core.utils:GlobalMemoryBuffer.get_tensor": "40f2edef1c66f1a5",
    "megatron.core.utils:GlobalSymmetricMemoryBuffer.__init__": "b76eace4e1a151b8",
    "megatron.core.utils:check_param_hashes_across_dp_replicas": "58ac191bfe316299",
    "megatron.core.utils:local_multi_tensor_l2_norm": "128bb632d77616dc",
    "megatron.core.utils:StragglerDetector.configure": "f11d704cb995a933",
    "megatron.core.utils:StragglerDetector.elapsed": "47e72a4fe8d22028",
    "megatron.core.utils:get_batch_on_this_hybrid_cp_rank": "6dae5a7597c1a4f9",
    "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.__init__": "a90792e84777f23b",
    "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb": "09f87c7582f023bc",
    "megatron.core.models.common.embeddings.rotary_pos_embedding:MultimodalRotaryEmbedding.__init__": "ba1108f5241ef309",
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate_shapes": "02c505710bc2e4cb",
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate": "96baed651678bc59",
    "megatron.core.pipeline_parallel.schedules:forward_step": "29632237be2cf108",
    "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining": "e1aee81a7cb9ae19",
    "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving": "98a064cf490d2a19",
    "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving": "988e50158aeb474f",
    "megatron.core.transformer.utils:get_default_causal_mask": "510d896df7d6deca",
    "megatron.core.transformer.utils:get_sliding_window_causal_mask": "116b3ed3a8519ddf",
    "megatron.core.optimizer.clip_grads:get_grad_norm_fp32": "3ab7a7bbb25c84d7",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32": "d2d28092dcb2066f",
    "megatron.core.optimizer.clip_grads:count_zeros_fp32": "1fd2a2cc17103420",
    "megatron.core.models.gpt.gpt_model:GPTModel._preprocess": "c107f8e8f17cb56f",
    "megatron.core.transformer.attention:Attention._allocate_memory": "7fba838b541b5220",
    "megatron.core.optimizer.optimizer:MegatronOptimizer.restore_from_cpu": "e19e0656940e9cd8",
    "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.__init__": "5e17162e19b3c4e7",
    "megatron.core.optimizer.optimizer:FP32Optimizer.__init__": "d950fcfafebeab97",
    "megatron.core.optimizer.optimizer:ChainedOptimizer.get_loss_scale": "cf7d1cf031b3f78e",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict": "393f78388da771d3",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero": "6b5a766d0fee9570",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__": "500069dac412f151",
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.__init__": "031b2185fccd63b5",
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.offload_grad_buffers": "8da7d51fa5b68ae7",
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.restore_grad_buffers": "eda77f9d9448fa5d",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups": "e09973947a7f21da",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__": "c806fd0848fa4ce7",
    "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer": "e2c7af37cedcf258"
}

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

    version = getattr(megatron.core, "__version__", "unknown")
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
