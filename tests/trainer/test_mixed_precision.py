"""model.params_dtype: bf16 is megatron's mixed precision as GPU clusters run it (bf16 params,
fp32 main params and fp32 gradient reduction in megatron's optimizer, bf16 reference, bf16 KV
cache), through the real trainer at DP=2 on gloo; fp32 is the emulation's flow (fp32 params
whose bf16 copy the GEMMs read). Both must compute the same first rollout, and the same
update up to the bf16 rounding of the weight gradient."""
from __future__ import annotations

import pytest
import torch

from megatron_calibclip.config import ConfigError, from_dict
from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

CFG = merge(TINY_TRAIN, {
    "parallel": {"tp": 1},
    "run": {"tensorboard": False, "plot": False, "steps": 2, "checkpoint": False},
    "clipping": {"mode": "fixed"},
    "optimizer": {"lr": 1e-4},
})


def _train(rank, world_size, cfg_dict):
    from megatron.core.transformer.attention import Attention

    from megatron_calibclip.trainer import TrainConfig, train
    import megatron_calibclip.trainer.loop as loop

    seen = {"kv_dtypes": set()}
    real_step, real_alloc, real_build = loop.train_step, Attention._allocate_memory, loop.build_components

    def alloc(self, seq, batch, dim, dtype):
        seen["kv_dtypes"].add(dtype)
        return real_alloc(self, seq, batch, dim, dtype)

    def masters(c):
        """{name: fp32 master}: megatron's main param for a bf16 param, else the param."""
        return {n: getattr(p, "main_param", p).detach().clone()
                for n, p in c.policy.named_parameters()}

    def build(*args, **kwargs):
        c = real_build(*args, **kwargs)
        seen["built"] = {n: p.detach().clone() for n, p in c.policy.named_parameters()}
        return c

    def spy(c, step, **kw):
        if step == 0:  # after the supervised warm-up
            seen["initial"] = masters(c)
        out = real_step(c, step, **kw)
        seen["params"] = {n: p.detach().clone() for n, p in c.policy.named_parameters()}
        seen["masters"] = masters(c)
        seen["reference_dtypes"] = {p.dtype for p in c.reference.parameters()}
        opt = c.optimizer
        seen["optimizers"] = [type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])]
        return out

    loop.train_step, Attention._allocate_memory, loop.build_components = spy, alloc, build
    try:
        records = train(from_dict(TrainConfig, cfg_dict))["records"]
    finally:
        loop.train_step, Attention._allocate_memory = real_step, real_alloc
        loop.build_components = real_build
    return records, seen


def test_bf16_params_match_the_fp32_flow(dist_pool, tmp_path):
    runs = {}
    for name, dtype, distributed in (("fp32", "fp32", False), ("bf16", "bf16", False),
                                     ("bf16-distopt", "bf16", True)):
        cfg = merge(CFG, {"run": {"name": name, "output_dir": str(tmp_path)},
                          "model": {"params_dtype": dtype},
                          "optimizer": {"distributed": distributed}})
        (records, seen), _ = dist_pool(2).run(_train, cfg, timeout=600)
        runs[name] = (records, seen)
    (f_rec, f_seen), (b_rec, b_seen) = runs["fp32"], runs["bf16"]
    d_rec, d_seen = runs["bf16-distopt"]
    # megatron's distributed optimizer: fp32 main-param shards over DP, same bf16 model
    assert d_seen["optimizers"] == ["DistributedOptimizer"]
    # the same training up to the order of the gradient reduction (reduce-scatter vs
    # all-reduce): measured one bf16 ulp in the embedding, every other parameter equal
    for name, p in b_seen["params"].items():
        assert torch.allclose(d_seen["params"][name].float(), p.float(), rtol=2 ** -7, atol=1e-6)
    assert {p.dtype for p in d_seen["params"].values()} == {torch.bfloat16}

    # what was allocated, and what each run directory says it got
    import yaml

    from megatron_calibclip.fp8.gemm import native_bf16_gemms

    for name, dtype in (("fp32", "fp32"), ("bf16", "bf16"), ("bf16-distopt", "bf16")):
        resolved = yaml.safe_load((tmp_path / name / "resolved.yaml").read_text())
        code = {k: resolved.pop(k) for k in ("code.commit", "code.dirty")}  # the checkout's git state
        assert code["code.dirty"] in ("true", "false", "unknown")
        native, why = native_bf16_gemms()  # run.gemm_path auto: the hardware's choice, and why
        assert resolved.pop("gemm_path") == f"{'native' if native else 'fp32'} (auto: {why}" + (
            ")" if native else ", so fp32 GEMMs)")
        assert resolved == {"device": "cpu", "params_dtype": dtype, "fp8.backend": "emulated",
                            "rollout.fp8.backend": "emulated", "layer_spec": "emulated"}
    assert {p.dtype for p in b_seen["params"].values()} == {torch.bfloat16}
    assert {p.dtype for p in f_seen["params"].values()} == {torch.float32}
    assert b_seen["optimizers"] == ["Float16OptimizerWithFloat16Params"]
    assert f_seen["optimizers"] == ["FP32Optimizer"]
    assert {p.dtype for p in b_seen["masters"].values()} == {torch.float32}
    assert b_seen["reference_dtypes"] == f_seen["reference_dtypes"] == {torch.bfloat16}
    assert b_seen["kv_dtypes"] == {torch.bfloat16}
    # the bf16 params are the rounded fp32 main params (megatron copies main -> model)
    for name, p in b_seen["params"].items():
        assert torch.equal(p, b_seen["masters"][name].to(torch.bfloat16)), name
    # both start from the same weights as the GEMMs see them
    for name, f0 in f_seen["built"].items():
        assert torch.equal(f0.to(torch.bfloat16), b_seen["built"][name])

    # the rollout/trainer agreement is the same in both flows (a different forward in the
    # trainer than in the rollout would show here)
    assert abs(f_rec[0]["loss/mult_prob_error"] - b_rec[0]["loss/mult_prob_error"]) < 1e-3
    # the updates (supervised warm-up at lr 1e-3, then RL at 1e-4) agree up to the bf16
    # rounding of the weight gradients and of the bf16 run's starting masters: the two runs'
    # updates differ by a small part of the update itself (measured: 13% in both phases)
    def distance(a: dict, b: dict) -> float:
        return sum(float((a[n] - b[n]).norm() ** 2) for n in a) ** 0.5

    def update(seen, start, end):
        return {n: seen[end][n].float() - seen[start][n].float() for n in seen[end]}

    for start, end in (("built", "initial"), ("initial", "masters")):
        f_update, b_update = update(f_seen, start, end), update(b_seen, start, end)
        moved = distance(f_update, {n: torch.zeros_like(v) for n, v in f_update.items()})
        assert moved > 0 and distance(f_update, b_update) < 0.25 * moved, (start, end)


def test_fp32_gemms_with_bf16_params_are_refused():
    from megatron_calibclip.trainer import TrainConfig

    cfg = merge(CFG, {"model": {"params_dtype": "bf16"}, "precision": "fp32"})
    with pytest.raises(ConfigError, match="precision: 'fp32' GEMMs need fp32 parameters"):
        from_dict(TrainConfig, cfg)
    cfg = merge(CFG, {"model": {"params_dtype": "bf16"},
                      "clipping": {"calibration": {"shadow_precision": "fp32"}}})
    with pytest.raises(ConfigError, match="shadow_precision: 'fp32' GEMMs"):
        from_dict(TrainConfig, cfg)
    assert from_dict(TrainConfig, merge(CFG, {})).model.resolved_params_dtype() == (
        "bf16" if torch.cuda.is_available() else "fp32")


def test_gpu_check_holds_parameters_as_the_trainer_would():
    """tools/gpu_check.py builds its models in the trainer's params dtype for the device it
    checks (bf16 on CUDA, fp32 on the CPU for `auto`; docs/trainer.md), from the trainer's rule."""
    from megatron_calibclip.bench.gpu_check.common import trainer_params_dtype
    from megatron_calibclip.trainer import TrainConfig

    assert trainer_params_dtype("cuda") is torch.bfloat16
    assert trainer_params_dtype("cpu") is torch.float32
    model = from_dict(TrainConfig, merge(CFG, {})).model
    assert (model.resolved_params_dtype(cuda=True), model.resolved_params_dtype(cuda=False)) == (
        "bf16", "fp32")
    pinned = from_dict(TrainConfig, merge(CFG, {"model": {"params_dtype": "fp32"}})).model
    assert pinned.resolved_params_dtype(cuda=True) == "fp32"


def test_distributed_optimizer_checkpoints_are_refused_on_the_cpu(tmp_path):
    """Megatron's model-space optimizer formats gather the distributed optimizer's state
    through CUDA (fully_reshardable) or do not load into torch's Adam (both; 0.16.x and
    0.19.x): on the CPU the run stops in one line before building anything. dp_reshardable,
    the default, checkpoints there (tests/checkpoint/test_optimizer_format.py)."""
    from megatron_calibclip.trainer import TrainConfig
    from megatron_calibclip.trainer.components import build_components

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    cfg = from_dict(TrainConfig, merge(CFG, {
        "optimizer": {"distributed": True, "checkpoint_format": "fully_reshardable"},
        "run": {"checkpoint": True}}))
    with pytest.raises(ConfigError, match=r"optimizer\.checkpoint_format: fully_reshardable does "
                                          r"not work on CPU .*megatron-core 0\.16\.x and 0\.19\.x"):
        build_components(cfg, tmp_path)
    assert list(tmp_path.iterdir()) == []
