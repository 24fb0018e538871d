"""Every tensor the trainer owns lives on the device it trains on (issue 25 item 1).

A CPU run cannot tell "on the device" from "left on the host": both are the CPU. So the
trainer's components are built for the meta device (parallel.devices.cpu_stand_in: the
trainer's compute device, and megatron's CUDA allocations through the CPU patches, become
meta), then one FP8 forward+backward, one BF16 shadow forward and one optimizer step run on
it; every parameter, buffer, DDP gradient/parameter buffer, main parameter, optimizer state
and weight-cache tensor must be on meta. Before the fix (fd1fefe) the models were never moved
after building: all 42 parameters of policy and reference stayed on the host (megatron's
WrappedTorchNorm builds its weights with no device, and Megatron-LM's get_model moves the
model with `.cuda()` right after building; ours did not), and megatron's bf16 optimizer refused
the meta parameters' type. Exempt: torch's Adam keeps its `step` counters on the host by
design (not capturable, not fused), on a GPU too."""
from __future__ import annotations

import pytest

from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist


def _tensors_in(obj, path: str, out: list, seen: set, depth: int = 0) -> None:
    """Tensors reachable from `obj` through attributes, lists and dicts (not submodules)."""
    import torch

    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors_in(v, f"{path}[{i}]", out, seen, depth + 1)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            key = f"[{tuple(k.shape)}]" if isinstance(k, torch.Tensor) else f".{k}"
            _tensors_in(v, path + key, out, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for k, v in vars(obj).items():
            _tensors_in(v, f"{path}.{k}", out, seen, depth + 1)


def _module_state(model, name: str) -> list:
    """Parameters, buffers and the tensors modules hold in plain attributes (weight caches,
    FP8 state)."""
    out = [(f"{name}.{n}", t) for n, t in list(model.named_parameters()) + list(model.named_buffers())]
    for mod_name, m in model.named_modules():
        for k, v in vars(m).items():
            if k not in ("_parameters", "_buffers", "_modules"):
                _tensors_in(v, f"{name}.{mod_name}.{k}", out, set())
    return out


def _placement_body(rank, world_size, run_dir, params_dtype):
    from pathlib import Path

    import torch

    from megatron_calibclip.config import from_dict
    from megatron_calibclip.models import position_ids_for
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.parallel.devices import cpu_stand_in
    from megatron_calibclip.trainer import TrainConfig
    from megatron_calibclip.trainer.components import build_components

    from megatron_calibclip.fp8.weight_cache import set_weight_cache_policy

    set_weight_cache_policy("on")  # "verify" (the suite's) compares on the host: a debug policy
    meta = torch.device("meta")
    cfg = from_dict(TrainConfig, merge(TINY_TRAIN, {"model": {"params_dtype": params_dtype}}))
    seen: list = []
    with model_parallel(), cpu_stand_in(meta):
        c = build_components(cfg, Path(run_dir))
        seen += _module_state(c.policy, "policy") + _module_state(c.reference, "reference")
        for i, buf in enumerate(c.ddp.buffers):
            seen += [(f"ddp.buffers[{i}].{a}", getattr(buf, a)) for a in ("grad_data", "param_data")
                     if getattr(buf, a, None) is not None]
        seen += [(f"ddp.main_grad.{n}", p.main_grad) for n, p in c.policy.named_parameters()
                 if getattr(p, "main_grad", None) is not None]
        tokens = torch.randint(1, 100, (4, 8), device=meta)
        with c.trainer_precision():  # FP8: the quantized weight caches
            c.ddp(tokens, position_ids_for(tokens), None).float().sum().backward()
        seen += _module_state(c.policy, "policy-after-fp8")
        with c.shadow_precision(), torch.no_grad():  # BF16: the bf16 weight caches
            c.ddp(tokens, position_ids_for(tokens), None)
        seen += _module_state(c.policy, "policy-after-shadow")
        for group in c.optimizer.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        c.optimizer.optimizer.step()  # megatron's own step reads the grad norm on the host
        optimizer_state: list = []
        _tensors_in(c.optimizer.optimizer.state, "optimizer.state", optimizer_state, set())
        _tensors_in(getattr(c.optimizer, "fp32_from_float16_groups", []), "optimizer.main_params",
                    optimizer_state, set())
        seen += [(p, t) for p, t in optimizer_state if not p.endswith(".step")]
        kinds = {"weight_cache": sum("_entry" in p for p, _ in seen),
                 "optimizer": len([p for p, _ in seen if p.startswith("optimizer.")]),
                 "main_grad": sum(p.startswith("ddp.main_grad") for p, _ in seen)}
    return [(p, str(t.device)) for p, t in seen if t.device != meta], len(seen), kinds


@pytest.mark.parametrize("params_dtype", ["fp32", "bf16"])
def test_every_trainer_tensor_lives_on_the_training_device(dist_pool, tmp_path, params_dtype):
    wrong, count, kinds = dist_pool(1).run(_placement_body, str(tmp_path), params_dtype)[0]
    assert not wrong, f"{len(wrong)} of {count} tensors are not on the device: {wrong[:10]}"
    assert count > 100 and kinds["weight_cache"] > 0 and kinds["optimizer"] > 0 and kinds["main_grad"] > 0, kinds

