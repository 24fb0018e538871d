"""Batched delayed-scaling amax reduction (fp8.delayed.batched_amax_reduction): the same scales
as one reduction per tensor, in one collective per flush.

References: the scale formula written out here (TE's (fp8_max / amax) / 2**margin over the
window's max), and on gloo the same model and data run with batching switched off."""
import contextlib
import importlib

import pytest
import torch

from megatron_calibclip.fp8 import FP8Recipe
from megatron_calibclip.fp8.delayed import AmaxHistory, PendingAmaxError, batched_amax_reduction
from megatron_calibclip.fp8.formats import E4M3

E4M3_MAX = 448.0


def _hand_scale(amaxes, history_len, margin=0):
    """(fp8_max / max of the last `history_len` amaxes) / 2**margin, in fp32 as TE computes."""
    window = torch.tensor(amaxes[-history_len:], dtype=torch.float32)
    return (torch.tensor(E4M3_MAX) / window.max()) / (2.0 ** margin)


def test_reads_inside_a_batch_see_the_scale_without_batching():
    a, b = AmaxHistory(E4M3, 3, "max", 0), AmaxHistory(E4M3, 3, "max", 0)
    seen_a, seen_b = [], []
    with batched_amax_reduction() as batch:
        a.record(torch.tensor(2.0))
        b.record(torch.tensor(8.0))
        assert a._batch is batch and a.waiting and a.updates == 0  # waiting, not yet applied
        with pytest.raises(PendingAmaxError, match="quantize_scale"):
            a.scale  # inspection never communicates: it refuses while an amax waits
        seen_a.append(a.quantize_scale())  # the quantizers' read applies the batch first
        assert a.updates == 1 and b.updates == 1 and not a.waiting
        a.record(torch.tensor(4.0))
        a.record(torch.tensor(1.0))  # a second amax of `a` in the batch: the first goes first
        seen_b.append(b.quantize_scale())
        b.record(torch.tensor(16.0))
    assert batch.collectives == 0  # no group: nothing to communicate
    assert torch.equal(seen_a[0], _hand_scale([2.0], 3))
    assert torch.equal(seen_b[0], _hand_scale([8.0], 3))
    assert torch.equal(a.scale, _hand_scale([2.0, 4.0, 1.0], 3)) and a.updates == 3
    assert torch.equal(b.scale, _hand_scale([8.0, 16.0], 3)) and b.updates == 2
    assert torch.equal(a.history, torch.tensor([1.0, 4.0, 2.0]))


def test_outside_a_batch_record_applies_at_once_and_nesting_joins_the_outer():
    a = AmaxHistory(E4M3, 2, "most_recent", 1)
    a.record(torch.tensor(7.0))
    assert a.updates == 1 and torch.equal(a.scale, torch.tensor(E4M3_MAX) / torch.tensor(7.0) / 2.0)
    with batched_amax_reduction() as outer:
        with batched_amax_reduction() as inner:
            a.record(torch.tensor(3.0))
        assert inner is outer and a.updates == 1  # the inner exit does not flush
    assert a.updates == 2 and torch.equal(a.scale, torch.tensor(E4M3_MAX) / torch.tensor(3.0) / 2.0)


def test_a_block_that_raises_drops_its_pending_amaxes():
    a = AmaxHistory(E4M3, 2, "max", 0)
    with pytest.raises(KeyError):
        with batched_amax_reduction():
            a.record(torch.tensor(5.0))
            raise KeyError("boom")
    assert a.updates == 0 and a._batch is None and torch.equal(a.scale, torch.tensor(1.0))
    a.record(torch.tensor(5.0))  # and the next record applies at once again
    assert a.updates == 1


def test_snapshot_inside_a_batch_includes_the_pending_amax_and_stays_out_of_it():
    a = AmaxHistory(E4M3, 2, "max", 0)
    with batched_amax_reduction():
        a.record(torch.tensor(2.0))
        snap = a.snapshot()
        snap.record(torch.tensor(64.0))  # a snapshot's record applies at once, unbatched
        assert not snap.waiting and snap.updates == 2
    assert torch.equal(snap.scale, _hand_scale([2.0, 64.0], 2))
    assert torch.equal(a.scale, _hand_scale([2.0], 2)) and a.updates == 1


class _CountingDist:
    """Stands in for torch.distributed inside fp8.delayed: counts its amax all-reduces."""

    def __init__(self, real):
        self._real, self.all_reduces = real, 0

    def all_reduce(self, *args, **kwargs):
        self.all_reduces += 1
        return self._real.all_reduce(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _states(model):
    from megatron_calibclip.fp8 import emulated_linears

    return [s for m in emulated_linears(model) for s in m._amax_states.values()]


@contextlib.contextmanager
def _counted_amax_reductions(module, batched):
    """Count fp8.delayed's all-reduces; with `batched` False, `module`'s batched_amax_reduction
    (the name it imported) is switched off for the block (the reference run)."""
    import torch.distributed as dist

    import megatron_calibclip.fp8.delayed as delayed

    counter = _CountingDist(dist)
    delayed.dist = counter
    real_batching = module.batched_amax_reduction
    if not batched:
        module.batched_amax_reduction = contextlib.nullcontext
    try:
        yield counter
    finally:
        delayed.dist = dist
        module.batched_amax_reduction = real_batching


def _tiny_delayed_model():
    """The tiny GPT with emulated linears and a delayed recipe, amaxes reduced over TP."""
    from megatron_calibclip.fp8 import fp8_linear_classes
    from megatron_calibclip.models import build_policy_model, get_preset, local_layer_spec

    cfg = get_preset("tiny")
    model = build_policy_model(cfg, spec=local_layer_spec(cfg, **fp8_linear_classes()), seed=0)
    return cfg, model, FP8Recipe(granularity="delayed", amax_history_len=4, amax_reduction="tp")


def _trainer_body(rank, world_size, batched):
    """Two steps of the trainer's schedule (log-probs forward, update forward + backward, 3
    micro-batches each) on a TP=2 tiny GPT in delayed FP8, amaxes reduced over TP."""
    import megatron_calibclip.trainer.forward as fwd
    from megatron_calibclip.fp8 import set_precision
    from megatron_calibclip.parallel import model_parallel

    with _counted_amax_reductions(fwd, batched) as counter:
        with model_parallel(tp=2):
            cfg, model, recipe = _tiny_delayed_model()
            set_precision(model, "fp8", recipe)
            tokens = torch.randint(1, 1000, (6, 24), generator=torch.Generator().manual_seed(5))
            mask = torch.zeros(6, 1, 1, 24, dtype=torch.bool)
            kw = dict(vocab_size=cfg.vocab_size, temperature=1.0, micro_batch_size=2, pad_id=0)
            out = {"lp": [], "grads": [], "scales": []}
            mbs, _ = fwd.split_micro_batches({"tokens": tokens, "attention_mask": mask}, 2,
                                             {"tokens": 0, "attention_mask": True})

            def loss_fn(mb, logits):
                lp, _ = fwd.token_logprobs(logits, mb["tokens"], cfg.vocab_size, 1.0)
                return -lp.mean(), {}

            calls = []
            for _ in range(2):
                before = counter.all_reduces
                out["lp"].append(fwd.compute_logprobs(model, tokens, mask, **kw)[0])
                model.zero_grad()
                middle = counter.all_reduces
                fwd.run_schedule(model, mbs, loss_fn, forward_only=False, seq_length=24)
                calls.append((middle - before, counter.all_reduces - middle))
                out["grads"].append([p.grad.clone() for p in model.parameters()])
                out["scales"].append([s.scale.clone() for s in _states(model)])
            out["calls"] = calls
            out["n_linears"] = len(_states(model)) // 3
            out["updates"] = sorted({s.updates for s in _states(model)})
    return out


@pytest.mark.dist
def test_trainer_schedule_reduces_each_micro_batch_in_one_collective(dist_pool):
    pool = dist_pool(2)
    batched, single = pool.run(_trainer_body, True), pool.run(_trainer_body, False)
    for b, s in zip(batched, single):  # every rank: bit for bit the same numbers
        assert all(torch.equal(x, y) for x, y in zip(b["lp"], s["lp"]))
        assert all(torch.equal(x, y) for gb, gs in zip(b["grads"], s["grads"])
                   for x, y in zip(gb, gs))
        assert all(torch.equal(x, y) for sb, ss in zip(b["scales"], s["scales"])
                   for x, y in zip(sb, ss))
    n = batched[0]["n_linears"]
    assert n == 8  # 2 layers x (qkv, proj, fc1, fc2) on each rank
    # 3 micro-batches. Log-probs: activation + weight per linear per forward. Update: the
    # same, plus the gradient in each backward. Batched: one collective per micro-batch.
    for res in single:
        assert res["calls"] == [(3 * 2 * n, 3 * 3 * n)] * 2
    for res in batched:
        assert res["calls"] == [(3, 3)] * 2
    # every amax was applied: 2 steps x (3 log-prob + 3 update) forwards, 2 x 3 backwards
    assert batched[0]["updates"] == single[0]["updates"] == [6, 12]
    # the TP ranks agree on every scale (reduced, not per rank)
    assert all(torch.equal(x, y) for x, y in zip(batched[0]["scales"][-1], batched[1]["scales"][-1]))


def _decode_body(rank, world_size, which, batched):
    """The decode loop of the rollout (trainer.rollout_factory.build_rollout_engine) or of the
    held-out evaluation (trainer.evaluation.evaluation_engine), built as the trainer builds
    it, on a TP=2 tiny GPT in delayed FP8: 1 prompt pass + up to 5 decode steps. `batched`
    False switches the batching inside fp8.precision off (the reference)."""
    import types

    from megatron_calibclip.config import from_dict
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.rollout.sampling import SamplingParams
    from megatron_calibclip.trainer import TrainConfig
    from megatron_calibclip.trainer.evaluation import evaluation_engine
    from megatron_calibclip.trainer.rollout_factory import build_rollout_engine
    from tests.train_configs import TINY_TRAIN, merge

    # the module (the package's `precision` attribute is the context-manager function)
    precision_module = importlib.import_module("megatron_calibclip.fp8.precision")
    with _counted_amax_reductions(precision_module, batched) as counter:
        with model_parallel(tp=2):
            model_cfg, model, _ = _tiny_delayed_model()
            cfg = from_dict(TrainConfig, merge(TINY_TRAIN, {
                "rollout": {"engine": "megatron", "precision": "fp8"},
                "evaluation": {"precision": "fp8"},
                "fp8": {"granularity": "delayed", "amax_history_len": 4, "amax_reduction": "tp"}}))
            tokenizer = types.SimpleNamespace(eos_id=-1, pad_id=0)  # no EOS: every step decodes
            if which == "rollout":
                engine = build_rollout_engine(cfg, model_cfg, model, tokenizer)
            else:
                engine = evaluation_engine(types.SimpleNamespace(
                    cfg=cfg, policy=model, model_cfg=model_cfg, tokenizer=tokenizer, engine=None))
            batch = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=1.0,
                                                                       max_new_tokens=6), seed=3)
            return {"tokens": batch.tokens, "lp": batch.rollout_logprobs,
                    "calls": counter.all_reduces, "n_linears": len(_states(model)) // 3,
                    "scales": [s.scale for s in _states(model)]}


@pytest.mark.dist
@pytest.mark.parametrize("which", ["rollout", "evaluation"])
def test_decode_loops_reduce_each_forward_in_one_collective(dist_pool, which):
    pool = dist_pool(2)
    batched, single = pool.run(_decode_body, which, True), pool.run(_decode_body, which, False)
    for b, s in zip(batched, single):
        assert torch.equal(b["tokens"], s["tokens"]) and torch.equal(b["lp"], s["lp"])
        assert all(torch.equal(x, y) for x, y in zip(b["scales"], s["scales"]))
    n = batched[0]["n_linears"]
    # 6 forwards (the prompt, then 5 decode steps: the 6th token needs no forward)
    assert [r["calls"] for r in single] == [6 * 2 * n] * 2
    assert [r["calls"] for r in batched] == [6] * 2
