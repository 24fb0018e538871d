"""Device-correctness on the CPU: the package names a device for every tensor it creates.

Three checks (docs/devices.md): the runtime guard (tests/strict_device.py) catches a planted
implicit-device tensor and lets explicit ones pass; a full training run (warm-up, rollout,
log-probs, shadow pass, calibration, update, metrics, checkpoint) at DP=2 and at TP=2, and a
probe run, create no tensor without a device; and a static scan of the package finds no
factory call without `device=` (it also covers the code these runs do not reach: PP, GPU
branches, tools).
"""
import ast
from pathlib import Path

import pytest
import torch

from tests.strict_device import PACKAGE_DIR, StrictDeviceError, strict_device
from tests.train_configs import TINY_TRAIN, merge

PLANTED = (
    "import torch\n"
    "def make(n):\n"
    "    return torch.zeros(n), torch.Generator(), torch.zeros(n, device=torch.device('cpu'))\n"
)


def _planted_module():
    """A function whose frames claim to be inside megatron_calibclip (nothing is written)."""
    namespace: dict = {}
    exec(compile(PLANTED, str(Path(PACKAGE_DIR) / "_planted_for_test.py"), "exec"), namespace)
    return namespace["make"]


def test_guard_catches_a_planted_implicit_device_tensor():
    make = _planted_module()
    with pytest.raises(StrictDeviceError) as err:
        with strict_device():
            make(3)
    text = str(err.value)
    assert "_planted_for_test.py:3 (make): torch.zeros without device=" in text
    assert "torch.Generator without device=" in text
    assert text.count("without device=") == 2  # the explicit torch.zeros(device=...) passes


def test_guard_ignores_explicit_devices_inherited_devices_and_other_callers():
    with strict_device() as report:
        x = torch.zeros(3)  # a test frame, not the package
        torch.Generator()
        from megatron_calibclip.rl.dapo import overlong_penalty

        overlong_penalty(torch.tensor([1, 5]), max_length=4, cache_length=2)  # as_tensor(tensor)
        torch.zeros_like(x)
    assert report.sites == []
    assert torch.Generator is torch._C.Generator  # restored


# ---- the package, statically ---------------------------------------------------------------
FACTORY_NAMES = {"arange", "as_tensor", "asarray", "empty", "empty_strided", "eye", "full",
                 "linspace", "logspace", "ones", "rand", "randint", "randn", "randperm", "range",
                 "scalar_tensor", "tensor", "zeros", "Generator", "from_numpy", "normal",
                 "tril_indices", "triu_indices"}
DEVICE_MODULE = Path(PACKAGE_DIR) / "parallel" / "devices.py"


def _static_violations(path: Path) -> list[str]:
    """`torch.<factory>(...)` without device=, and string-literal devices (use devices.py)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        if not (isinstance(func.value, ast.Name) and func.value.id == "torch"):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        where = f"{path.relative_to(Path(PACKAGE_DIR).parent)}:{node.lineno}"
        if func.attr in FACTORY_NAMES and "device" not in keywords and None not in keywords:
            out.append(f"{where}: torch.{func.attr} without device=")
        literal = keywords.get("device")
        if func.attr == "device" and node.args:
            literal = node.args[0]
        if (isinstance(literal, ast.Constant) and isinstance(literal.value, str)
                and path != DEVICE_MODULE):
            out.append(f"{where}: device {literal.value!r} spelled out (use parallel/devices.py)")
    return out


def test_every_factory_call_in_the_package_names_a_device():
    found = [v for p in sorted(Path(PACKAGE_DIR).rglob("*.py")) for v in _static_violations(p)]
    assert not found, "tensors created without an explicit device:\n  " + "\n  ".join(found)


# ---- the package, running ------------------------------------------------------------------
def _train_body(rank, world_size, cfg_dict, out_dir):
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train

    cfg = from_dict(TrainConfig, merge(cfg_dict, {"run": {"output_dir": out_dir}}))
    with strict_device(raise_on_exit=False) as report:
        records = train(cfg)["records"]
    return report.sites, records


GUARDED_BASE = merge(TINY_TRAIN, {"run": {"steps": 2, "tensorboard": False, "plot": False},
                                  "warmup": {"steps": 1},
                                  "clipping": {"calibration": {"period": 1}}})
GUARDED_CASES = {  # both calibrate on every step (shadow passes, histograms, all-reduces)
    "dp2-grpo-token-mean-eval": {"loss": {"loss_agg_mode": "token-mean", "correction": "mis-token"},
                                 "evaluation": {"every": 1, "size": 8}},
    "tp2-grpo-bf16-rollout": {"parallel": {"tp": 2}, "rollout": {"precision": "bf16"}},
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(GUARDED_CASES))
def test_training_creates_no_tensor_without_a_device(dist_pool, tmp_path, case):
    cfg = merge(merge(GUARDED_BASE, GUARDED_CASES[case]), {"run": {"name": case}})
    results = dist_pool(2).run(_train_body, cfg, str(tmp_path), timeout=400)
    for rank, (sites, records) in enumerate(results):
        assert not sites, f"rank {rank}: tensors created without a device:\n  " + "\n  ".join(sites)
        assert [r["step"] for r in records] == [0, 1]
    trained = [r for r in results[0][1] if "skipped" not in r]
    assert any("calib/ran" in r for r in trained), "a calibration step must have run"
    if "evaluation" in GUARDED_CASES[case]:
        assert any("eval/accuracy" in r for r in results[0][1]), "an evaluation must have run"
    assert (tmp_path / case / "checkpoints").is_dir()


def _probe_body(rank, world_size):
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.probe import ProbeConfig, run_fp8_noise

    cfg = ProbeConfig(model="tiny", tokens="samples", num_seqs=4, sample_len=6,
                      warmup_steps=2, recipes=("tensorwise", "delayed"), lrs=(1e-5,),
                      old_micro_batch=4, micro_batch=2)
    with model_parallel(tp=1):
        with strict_device(raise_on_exit=False) as report:
            result = run_fp8_noise(cfg, log=lambda _m: None)
    return report.sites, result["data"]["num_tokens"]


@pytest.mark.dist
def test_probe_creates_no_tensor_without_a_device(dist_pool):
    for rank, (sites, tokens) in enumerate(dist_pool(2).run(_probe_body, timeout=300)):
        assert not sites, f"rank {rank}: tensors created without a device:\n  " + "\n  ".join(sites)
        assert tokens > 0
