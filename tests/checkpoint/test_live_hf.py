"""The live policy's weights as HF tensors (checkpoint/live_hf.py): TP shards gathered and PP
stages broadcast give, on every rank, exactly the tensors of the unsharded model; buckets stay
within their byte limit; the stream follows the mapping's order."""
import pytest
import torch

from megatron_calibclip.checkpoint import mapping
from megatron_calibclip.checkpoint.live_hf import unshard
from megatron_calibclip.models.init import shard_of

pytestmark = pytest.mark.dist

PRESETS = ["tiny", "tiny-qwen2", "tiny-qwen3"]


def _stream_body(rank, world_size, tp, pp, preset, bucket_bytes):
    from megatron_calibclip.checkpoint.live_hf import hf_weight_buckets
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import model_parallel

    cfg = get_preset(preset)
    with model_parallel(tp=tp, pp=pp):
        model = build_policy_model(cfg, seed=7)  # layout-independent: same full weights
        buckets = [[(n, t.detach().clone()) for n, t in b]
                   for b in hf_weight_buckets(model, cfg, bucket_bytes)]
    return buckets


@pytest.mark.parametrize("preset", PRESETS)
def test_tp2_and_pp2_streams_equal_the_unsharded_model(dist_pool, preset):
    pool = dist_pool(2)
    big = 1 << 40
    reference = pool.run(_stream_body, 1, 1, preset, big)[0]  # DP=2: each rank whole
    ref = dict(pair for bucket in reference for pair in bucket)
    from megatron_calibclip.models import get_preset

    cfg = get_preset(preset)
    assert list(ref) == [n for e in mapping.resolve(cfg) for n in e.hf]  # the mapping's order
    for tp, pp in ((2, 1), (1, 2)):
        for rank_buckets in pool.run(_stream_body, tp, pp, preset, big):
            got = dict(pair for bucket in rank_buckets for pair in bucket)
            assert list(got) == list(ref)
            for name, tensor in got.items():
                assert tensor.shape == ref[name].shape, name
                assert torch.equal(tensor, ref[name]), f"TP={tp} PP={pp}: {name} differs"


def test_buckets_are_bounded(dist_pool):
    limit = 40_000  # bytes: a few tiny tensors; the embedding (1000 x 64 fp32) alone exceeds it
    out = dist_pool(2).run(_stream_body, 2, 1, "tiny", limit)[0]
    sizes = [[t.numel() * t.element_size() for _, t in b] for b in out]
    assert len(out) > 3
    for bucket in sizes:
        assert sum(bucket) <= limit or len(bucket) == 1, bucket
    assert any(len(b) > 1 for b in sizes)  # small tensors do share a bucket


@pytest.mark.parametrize("stride", [1, 2])
def test_unshard_inverts_shard_of(stride):
    full = torch.arange(8 * 6.0).reshape(8, 6)
    for dim in (0, 1):
        if full.shape[dim] % (2 * stride):
            continue
        shards = [shard_of(full, dim, stride, r, 2) for r in range(2)]
        assert torch.equal(unshard(shards, dim, stride), full)
