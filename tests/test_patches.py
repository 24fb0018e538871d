"""The CPU patches for megatron-core: they match the pinned version and change only what they say."""
import importlib
import importlib.metadata

import megatron.core
import pytest
import torch

from megatron_calibclip import patches
from megatron_calibclip.patches import sites


def test_pinned_megatron_version():
    # the release from the metadata: 0.19's __version__ appends the git commit of a repository
    # its files sit in (a .venv312 inside a fresh clone: "0.19.2+c5395fd")
    installed = importlib.metadata.version("megatron-core")
    assert installed == patches.MADE_FOR_MEGATRON_CORE, (
        f"patches have tables for megatron-core {', '.join(sites.SUPPORTED_RELEASES)}, installed "
        f"{installed}: run tools/patch_fingerprints.py and review the patches"
    )


def test_one_table_per_supported_line():
    """docs/versions.md: 0.16 (Python 3.11) and 0.19 (Python 3.12), one reviewed table each;
    every table names the release it was written for and lists its sites' fingerprints."""
    assert [r.rsplit(".", 1)[0] for r in sites.SUPPORTED_RELEASES] == ["0.16", "0.19"]
    for release in sites.SUPPORTED_RELEASES:
        table = sites.release_table(release)
        assert table["megatron_core"] == release
        assert set(table["fingerprints"]) == set(sites.all_patched_sites(table))
    # an untested release is served by the table of the newest earlier line (with a warning)
    assert sites.table_release("0.17.1") == "0.16.1"
    assert sites.table_release("0.19.9") == "0.19.2"
    assert sites.table_release("0.20.0") == "0.19.2"


def test_every_function_the_patches_rely_on_is_unchanged():
    changed = {
        site: (expected, patches.source_fingerprint(site))
        for site, expected in patches.FINGERPRINTS.items()
        if patches.source_fingerprint(site) != expected
    }
    assert not changed, f"megatron-core changed functions that patches/ relies on: {changed}"
    assert set(patches.FINGERPRINTS) == set(patches.all_patched_sites())


@pytest.mark.parametrize("module_name", sorted(patches.PROXIED_MODULES))
def test_no_unhandled_cuda_call_sites(module_name):
    """A new CUDA call site in a proxied module means the patch list must be reviewed."""
    assert patches.cuda_sites(module_name) == patches.PROXIED_MODULES[module_name]


def test_apply_is_idempotent_and_scoped():
    assert not torch.cuda.is_available()
    assert patches.apply_cpu_patches() is True
    assert patches.apply_cpu_patches() is True
    for name in patches.PROXIED_MODULES:
        module = importlib.import_module(name)
        assert isinstance(module.torch, patches._TorchProxy), name
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    # inside a proxied module 'cuda' allocations land on the CPU...
    assert mappings.torch.cuda.current_device() == torch.device("cpu")
    assert mappings.torch.empty(3, device="cuda").device.type == "cpu"
    assert mappings.torch.zeros(2, device=torch.device("cuda")).device.type == "cpu"
    # ...while torch itself is untouched
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    assert mappings.torch.float32 is torch.float32
    assert mappings.torch.distributed is torch.distributed


def test_rng_tracker_forks_restore_the_default_state():
    from megatron.core.tensor_parallel import random as mp_random

    patches.apply_cpu_patches()
    tracker = mp_random.CudaRNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("model-parallel-rng", 123)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        inside_a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default state"
    with tracker.fork("model-parallel-rng"):
        inside_b = torch.rand(3)
    assert not torch.equal(inside_a, inside_b), "the tracked stream must advance"
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), inside_a), "the tracked stream is seeded by add()"


def test_tensor_cuda_is_identity_only_inside_the_wrapped_method():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    patches.apply_cpu_patches()
    method = LanguageModule.setup_embeddings_and_output_layer
    assert getattr(method, "__calibclip_patched__", False)
    original = torch.Tensor.cuda
    seen = {}

    def probe(*args, **kwargs):
        t = torch.ones(2)
        seen["same"] = t.cuda() is t

    patches._cuda_is_identity(probe)()
    assert seen["same"] is True
    assert torch.Tensor.cuda is original


def test_cpu_tensors_report_cuda_type_names_only_inside_wrapped_optimizer_code():
    from megatron.core.optimizer import clip_grads, optimizer

    patches.apply_cpu_patches()
    assert clip_grads.clip_grad_by_total_norm_fp32 is optimizer.clip_grad_by_total_norm_fp32
    seen = {}

    def probe():
        seen["fp32"] = torch.ones(1).type()
        seen["bf16"] = torch.ones(1, dtype=torch.bfloat16).type()
        seen["cast"] = torch.ones(1).type(torch.float64).dtype

    patches._cpu_reports_cuda_type(probe)()
    assert seen == {"fp32": "torch.cuda.FloatTensor", "bf16": "torch.cuda.BFloat16Tensor",
                    "cast": torch.float64}
    assert torch.ones(1).type() == "torch.FloatTensor"  # restored outside
    # a real clip: grads are scaled down to max_norm
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=6.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)


def test_the_cuda_scan_sees_every_torch_cuda_use():
    """The scan behind PROXIED_MODULES missed 0.19's `torch.cuda.current_stream()` (it knew five
    torch.cuda calls); any torch.cuda attribute, .cuda() call or "cuda" string counts now."""
    import ast

    from megatron_calibclip.patches.fingerprint import _mentions_cuda

    for src in ("def f():\n    s = torch.cuda.current_stream()",
                "def f():\n    with torch.cuda.stream(s):\n        pass",
                "def f(t):\n    return t.cuda()",
                "def f():\n    return torch.zeros(1, device='cuda')"):
        assert _mentions_cuda(ast.parse(src).body[0]), src
    assert not _mentions_cuda(ast.parse("def f(x):\n    return x.device.type == 'cpu'").body[0])


def test_the_shim_stream_is_a_cpu_no_op():
    patches.apply_cpu_patches()
    buffers = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
    stream = buffers.torch.cuda.current_stream()
    stream.wait_stream(stream)  # what 0.19's grad sync does; in order on the CPU
    assert isinstance(stream, torch.cpu.Stream)
