"""The planner's model-state and KV-cache bytes against what the real trainer allocates.

The planner sizes H100 layouts with byte counts per parameter (planner/states.py) and per
cached token (planner/rollout.py); a trainer that allocated something else (fp32 weights
where bf16 were planned, a KV cache in another dtype, a forgotten fp32 master copy) would
make every plan wrong. Here the trainer runs one step at TP=2 on gloo and the test sums the
bytes of what it holds on each rank: policy parameters, main gradients, optimizer
(fp32 main parameters + Adam states), reference parameters, and the KV cache one rollout
allocates; the planner must predict each exactly, for bf16 parameters (what GPUs run) and
fp32 parameters (the CPU emulation's flow).
"""
from __future__ import annotations

import pytest

from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

CFG = merge(TINY_TRAIN, {
    "parallel": {"tp": 2},
    "run": {"tensorboard": False, "plot": False, "steps": 1, "checkpoint": False},
    "warmup": {"steps": 0},
    "clipping": {"mode": "fixed"},
})


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _measure(rank, world_size, cfg_dict):
    """Bytes this rank holds after one training step, and what the planner needs to predict
    them (the model config the trainer built, the KV cache's batch and length)."""
    from megatron.core.transformer.attention import Attention

    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train
    import megatron_calibclip.trainer.loop as loop

    kv = []
    real_step, real_alloc = loop.train_step, Attention._allocate_memory

    def alloc(self, seq, batch, dim, dtype):
        memory = real_alloc(self, seq, batch, dim, dtype)
        kv.append((seq, batch, _nbytes(memory)))
        return memory

    out = {}

    def spy(c, step, **kw):
        metrics = real_step(c, step, **kw)
        model_params = {id(p) for p in c.policy.parameters()}
        opt, states = c.optimizer, 0
        for inner in getattr(opt, "chained_optimizers", [opt]):
            for group in inner.optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in model_params:  # an fp32 main copy of a bf16 parameter
                        states += _nbytes(p)
                    states += sum(_nbytes(v) for k, v in inner.optimizer.state[p].items()
                                  if k != "step")  # Adam m and v
        out.update(
            model_cfg=c.model_cfg,
            weights=sum(_nbytes(p) for p in c.policy.parameters()),
            grads=sum(_nbytes(p.main_grad) for p in c.policy.parameters()),
            optimizer=states,
            reference=sum(_nbytes(p) for p in c.reference.parameters()),
        )
        return metrics

    loop.train_step, Attention._allocate_memory = spy, alloc
    try:
        train(from_dict(TrainConfig, cfg_dict))
    finally:
        loop.train_step, Attention._allocate_memory = real_step, real_alloc
    out["kv"] = kv
    return out


@pytest.mark.parametrize("params_dtype", ["bf16", "fp32"])
def test_planner_predicts_the_trainers_bytes(dist_pool, tmp_path, params_dtype):
    from megatron_calibclip.planner.params import stage_params
    from megatron_calibclip.planner.rollout import kv_cache_bytes
    from megatron_calibclip.planner.spec import Layout
    from megatron_calibclip.planner.states import DTYPE_BYTES, model_states

    cfg = merge(CFG, {"run": {"name": params_dtype, "output_dir": str(tmp_path)},
                      "model": {"params_dtype": params_dtype}})
    for got in dist_pool(2).run(_measure, cfg, timeout=600):
        m = got["model_cfg"]
        layout = Layout(tp=2, pp=1, dp=1, distributed_optimizer=False, precision="bf16",
                        params_dtype=params_dtype, reference_dtype="bf16",
                        kv_cache_dtype=params_dtype)
        planned = model_states(stage_params(m, 2, 1, 0), layout, reference_resident=True)
        assert got["weights"] == planned.weights
        assert got["grads"] == planned.grads  # fp32 main gradients (grad_reduce_in_fp32)
        assert got["optimizer"] == planned.optimizer
        assert got["reference"] == planned.reference
        # one rollout's KV cache: one allocation per layer for K and one for V
        seq, batch = got["kv"][0][:2]
        first = got["kv"][: 2 * m.num_layers]
        assert all((s, b) == (seq, batch) for s, b, _ in first)
        assert sum(n for _, _, n in first) == kv_cache_bytes(
            m, m.num_layers, 2, batch, seq, DTYPE_BYTES[params_dtype])


def _measure_save(rank, world_size, cfg_dict):
    """Tensor bytes this rank's checkpoint save writes (torch's writer sees every shard megatron
    hands it), and the model config the trainer built."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train
    import megatron_calibclip.trainer.loop as loop

    written, seen = [], {}
    real_write, real_step = dcp.FileSystemWriter.write_data, loop.train_step

    def write(self, plan, planner):
        n = 0
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:  # objects (RNG, counters) are not tensors
                numel = 1
                for size in item.tensor_data.chunk.sizes:
                    numel *= size
                n += numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
        written.append(n)
        return real_write(self, plan, planner)

    def spy(c, step, **kw):
        seen["model_cfg"] = c.model_cfg
        seen["tensors"] = sum(1 for _ in c.policy.parameters())
        return real_step(c, step, **kw)

    dcp.FileSystemWriter.write_data, loop.train_step = write, spy
    try:
        train(from_dict(TrainConfig, cfg_dict))
    finally:
        dcp.FileSystemWriter.write_data, loop.train_step = real_write, real_step
    return {**seen, "written": written}


@pytest.mark.te_stand_in
@pytest.mark.parametrize("params_dtype, distributed", [("bf16", True), ("bf16", False),
                                                       ("fp32", False)],
                         ids=["bf16-dp_reshardable", "bf16-plain", "fp32-plain"])
def test_planner_predicts_the_save_bytes_of_the_trainer(dist_pool, tmp_path, params_dtype,
                                                        distributed):
    """The most loaded rank writes exactly what the planner counts as the save's staged host
    bytes (policy + reference weights + the optimizer state; up to the distributed
    optimizer's alignment padding); the other TP rank writes less by the norms both hold,
    which torch's planner writes once."""
    from megatron_calibclip.planner.params import stage_params
    from megatron_calibclip.planner.save import padding_bound, save_memory
    from megatron_calibclip.planner.spec import Layout

    cfg = merge(CFG, {"run": {"name": f"save-{params_dtype}-{distributed}", "checkpoint": True,
                              "save_every": 1, "output_dir": str(tmp_path)},
                      "model": {"params_dtype": params_dtype},
                      "optimizer": {"distributed": distributed}})
    results = dist_pool(2).run(_measure_save, cfg, timeout=600)
    m = results[0]["model_cfg"]
    layout = Layout(tp=2, pp=1, dp=1, distributed_optimizer=distributed, precision="bf16",
                    params_dtype=params_dtype, reference_dtype="bf16")
    planned = save_memory(stage_params(m, 2, 1, 0), layout)
    assert planned.format == ("dp_reshardable" if distributed else "plain")
    assert planned.gather_host == planned.gather_gpu == 0
    slack = padding_bound(results[0]["tensors"], layout)
    per_rank = [r["written"] for r in results]
    assert all(len(w) == 1 for w in per_rank), per_rank  # one save (step 1)
    most = max(w[0] for w in per_rank)
    assert planned.staged_host <= most <= planned.staged_host + slack, (per_rank, planned)
    assert min(w[0] for w in per_rank) < most  # the TP-replicated norms are written once
