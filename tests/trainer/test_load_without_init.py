"""With `model.load` set no rank draws a random init it would overwrite (issue 37, finding 9).

At 32B every rank drew its full random init on the host (models/init.py draws each parameter
whole, then keeps its shard) before `model.load` replaced it. Counted here: the calls into
every weight initialisation the build can reach (ours, models.init.initialize_weights, and
megatron-core's `_initialize_affine_weight_cpu/_gpu`, through which all of its local layers
initialise) while the trainer builds its policy and reference, at TP=2. A build without
`model.load` counts them (the counters see the init when there is one); one with it counts
none, keeps megatron's tensor-parallel attributes, and ends with the checkpoint's weights.
"""
from __future__ import annotations

import pytest
import torch

from tests.train_configs import TINY_TRAIN, merge

pytestmark = [pytest.mark.dist, pytest.mark.te_stand_in]

TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _counting(monkeypatch_targets, counts):
    """Wrap each (module, name) so that a call adds one to counts[name]."""
    saved = []
    for module, name in monkeypatch_targets:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        saved.append((module, name, real))
        setattr(module, name, counted)
    return saved


def _build_counting(cfg, run_dir):
    import megatron.core.tensor_parallel.layers as mlayers

    import megatron_calibclip.models.builder as builder
    from megatron_calibclip.trainer.components import build_components

    counts: dict[str, int] = {}
    saved = _counting([(builder, "initialize_weights"),
                       (mlayers, "_initialize_affine_weight_cpu"),
                       (mlayers, "_initialize_affine_weight_gpu")], counts)
    try:
        comps = build_components(cfg, run_dir)
    finally:
        for module, name, real in saved:
            setattr(module, name, real)
    return comps, counts


def _tp_attrs(model):
    return {n: tuple(getattr(p, a, None) for a in TP_ATTRS) for n, p in model.named_parameters()}


def _body(rank, world_size, root):
    from pathlib import Path

    from megatron_calibclip.checkpoint import CheckpointManager
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.trainer import TrainConfig

    root = Path(root)
    base = merge(TINY_TRAIN, {"run": {"checkpoint": False}})
    with model_parallel(tp=2):
        fresh, counted_fresh = _build_counting(from_dict(TrainConfig, base), root / "fresh")
        ckpt = root / "ckpt"
        CheckpointManager(ckpt).save(0, fresh.policy)
        loaded_cfg = from_dict(TrainConfig, merge(base, {"model": {"load": str(ckpt)}}))
        loaded, counted_loaded = _build_counting(loaded_cfg, root / "loaded")
        same = all(torch.equal(p, dict(fresh.policy.named_parameters())[n])
                   for n, p in loaded.policy.named_parameters())
        ref_same = all(torch.equal(p, dict(loaded.policy.named_parameters())[n].to(p.dtype))
                       for n, p in loaded.reference.named_parameters())
        return dict(fresh=counted_fresh, loaded=counted_loaded, same=same, ref_same=ref_same,
                    attrs_fresh=_tp_attrs(fresh.policy), attrs_loaded=_tp_attrs(loaded.policy),
                    attrs_ref=_tp_attrs(loaded.reference))


def test_model_load_draws_no_init_and_keeps_tensor_parallel_attributes(dist_pool, tmp_path):
    for rank, r in enumerate(dist_pool(2).run(_body, str(tmp_path))):
        # a fresh policy: megatron's init, then ours (seeded); the reference copies it
        assert r["fresh"].get("initialize_weights", 0) == 1, r["fresh"]
        assert r["fresh"].get("_initialize_affine_weight_cpu", 0) > 0, r["fresh"]
        assert r["loaded"] == {}, f"rank {rank}: initialised while loading: {r['loaded']}"
        assert r["same"] and r["ref_same"], rank  # the checkpoint's weights, in both models
        assert r["attrs_loaded"] == r["attrs_fresh"] == r["attrs_ref"], rank
        sharded = [n for n, a in r["attrs_loaded"].items() if a[0]]
        assert len(sharded) >= 5, sharded  # TP-sharded weights carry their attributes
