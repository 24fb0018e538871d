"""Distributed correctness of the megatron-core models on gloo, against single-process runs.

Every reference runs in a pool of ONE process (no model-parallel communication at all) with
the same seed; megatron's CPU initialisation makes the full weights independent of TP/PP,
which the tests check too before comparing outputs.
"""
from functools import partial

import numpy as np
import pytest
import torch

from tests.dist_utils import full_state, gather_vocab

pytestmark = pytest.mark.dist

PRESETS = ["tiny", "tiny-qwen2", "tiny-qwen3"]
SEQ, MBS, MICROBATCHES = 16, 2, 2


def _tokens(vocab: int, batch: int = MBS, seq: int = SEQ, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _logits_body(rank, world_size, presets, tp):
    from megatron_calibclip.models import build_policy_model, forward_logits, get_preset
    from megatron_calibclip.parallel import model_parallel

    out = {}
    with model_parallel(tp=tp):
        for name in presets:
            cfg = get_preset(name)
            model = build_policy_model(cfg, seed=0)
            with torch.no_grad():
                logits = forward_logits(model, _tokens(cfg.vocab_size))
            out[name] = (
                gather_vocab(logits, cfg.vocab_size),
                full_state(model, cfg.num_layers, cfg.vocab_size, grads=False),
            )
    return out


def _forward_step(cfg, data_iterator, model):
    from megatron.core import parallel_state

    from megatron_calibclip.models import position_ids_for, shifted_logprobs_entropy

    tokens = next(data_iterator)
    output = model(tokens, position_ids_for(tokens), None)

    def loss_func(logits):
        logp, entropy = shifted_logprobs_entropy(logits, tokens, cfg.vocab_size)
        # a loss with both terms, so that the entropy backward is exercised too
        loss = -logp.mean() + 0.1 * entropy.mean()
        return loss, {"loss": loss.detach().clone()}

    assert parallel_state.is_pipeline_last_stage() or output.dim() == 3
    return output, loss_func


def _fwd_bwd_body(rank, world_size, preset, tp, pp):
    """megatron's forward_backward schedule + DDP + finalize_model_grads, as the trainer uses."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import model_parallel

    with model_parallel(tp=tp, pp=pp):
        cfg = get_preset(preset)
        model = build_policy_model(cfg, seed=0)
        ddp = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
            model,
        )
        model.config.finalize_model_grads_func = finalize_model_grads
        batches = [_tokens(cfg.vocab_size, seed=100 + i) for i in range(MICROBATCHES)]
        losses = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, cfg),
            data_iterator=iter(batches),
            model=[ddp],
            num_microbatches=MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        last = parallel_state.is_pipeline_last_stage()
        loss = float(np.mean([float(d["loss"]) for d in losses])) if last else None
        grads = full_state(model, cfg.num_layers, cfg.vocab_size, grads=True)
        weights = full_state(model, cfg.num_layers, cfg.vocab_size, grads=False)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        return {"loss": loss, "grads": grads if tp_rank == 0 else {},
                "weights": weights if tp_rank == 0 else {}}


def _merge(results):
    """Union of per-stage dicts; the tied output_layer copy on the last stage is dropped
    (its grad was all-reduced into the embedding's, which is what PP=1 computes)."""
    loss = [r["loss"] for r in results if r["loss"] is not None]
    grads, weights = {}, {}
    for r in results:
        grads.update(r["grads"])
        weights.update(r["weights"])
    return loss[0], grads, weights


def _assert_same_tensors(got: dict, ref: dict, atol: float, what: str):
    keys_ref = {k for k in ref if not k.startswith("output_layer") or "output_layer" in got}
    assert set(got) >= keys_ref, f"{what}: missing {sorted(keys_ref - set(got))}"
    worst = max((float(np.abs(got[k] - ref[k]).max()), k) for k in keys_ref)
    assert worst[0] <= atol, f"{what}: max abs diff {worst[0]:.3g} at {worst[1]}"


@pytest.fixture(scope="module")
def references(dist_pool):
    """Single-process (world size 1) logits, weights, loss and grads for every case."""
    pool = dist_pool(1)
    refs = {"logits": pool.run(_logits_body, PRESETS, 1)[0]}
    for preset in ("tiny", "tiny-qwen3"):
        refs[preset] = _merge(pool.run(_fwd_bwd_body, preset, 1, 1))
    return refs


def test_tp2_logits_equal_single_process(dist_pool, references):
    got = dist_pool(2).run(_logits_body, PRESETS, 2)
    for name in PRESETS:
        ref_logits, ref_weights = references["logits"][name]
        for rank_out in got:
            logits, weights = rank_out[name]
            _assert_same_tensors(weights, ref_weights, 0.0, f"{name} TP=2 weights")
            diff = np.abs(logits - ref_logits).max()
            assert diff <= 1e-5, f"{name}: TP=2 logits differ by {diff:.3g}"
        assert np.abs(ref_logits).max() > 0.1  # not a degenerate all-zero model


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2-4ranks"])
def test_forward_backward_equals_single_process(dist_pool, references, preset, tp, pp):
    """PP=2 on 2 ranks and TP=2 x PP=2 on 4 ranks: loss and every gradient as PP=1."""
    ref_loss, ref_grads, ref_weights = references[preset]
    loss, grads, weights = _merge(dist_pool(tp * pp).run(_fwd_bwd_body, preset, tp, pp))
    what = f"{preset} TP={tp} PP={pp}"
    _assert_same_tensors(weights, ref_weights, 0.0, f"{what} weights")
    assert abs(loss - ref_loss) <= 1e-6, (loss, ref_loss)
    _assert_same_tensors(grads, ref_grads, 1e-6, f"{what} grads")
    assert max(np.abs(g).max() for g in ref_grads.values()) > 0  # grads really flowed
