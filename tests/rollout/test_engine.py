"""KV-cached generation from the megatron policy at TP=1, TP=2 and PP=2."""
import pytest
import torch

from megatron_calibclip.rollout import SamplingParams

pytestmark = pytest.mark.dist

PROMPTS = [[5, 17, 99, 3], [8, 2], [400, 401, 402, 403, 404, 405], [7]]


def _recompute(model, batch, vocab):
    """The trainer's view: one full forward over prompt + response, left padding masked."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    with torch.no_grad():
        logits = forward_logits(model, batch.tokens, attention_mask=batch.attention_mask())
        lp, _ = shifted_logprobs_entropy(logits, batch.tokens, vocab)
    return lp


def _gen_body(rank, world_size, tp, pp, preset, greedy):
    from megatron.core import parallel_state as ps

    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.rollout import MegatronRolloutEngine

    with model_parallel(tp=tp, pp=pp):
        cfg = get_preset(preset)
        model = build_policy_model(cfg, seed=0)
        engine = MegatronRolloutEngine(model, cfg.vocab_size, eos_id=999, pad_id=0)
        params = SamplingParams(max_new_tokens=6, greedy=greedy)
        batch = engine.generate(PROMPTS, params, seed=11)
        again = engine.generate(PROMPTS, params, seed=11)
        other = engine.generate(PROMPTS, params, seed=12)
        singles = [engine.generate([p], params, seed=11) for p in PROMPTS] if greedy else []
        out = {"tokens": batch.tokens, "lp": batch.rollout_logprobs,
               "mask": batch.response_mask, "lengths": batch.response_lengths,
               "same_seed": torch.equal(batch.tokens, again.tokens),
               "other_seed": torch.equal(batch.tokens, other.tokens),
               "singles": [(s.responses()[0], s.rollout_logprobs[0]) for s in singles],
               "training": model.training}
        if pp == 1:
            out["recomputed"] = _recompute(model, batch, cfg.vocab_size)
        out["last_stage"] = ps.is_pipeline_last_stage()
        return out


def _check_internal(out, greedy):
    mask = out["mask"]
    assert out["same_seed"], "generation must be deterministic for a seed"
    if not greedy:
        assert not out["other_seed"], "another seed must give other samples"
    assert out["training"] is True, "generate() must restore train mode"
    assert bool((out["lp"][~mask] == 0).all()) and bool((out["lp"][mask] < 0).all())
    assert mask.sum(1).tolist() == out["lengths"].tolist()
    if "recomputed" in out:
        diff = (out["recomputed"] - out["lp"])[mask].abs().max()
        assert diff <= 1e-5, f"rollout log-probs differ from the full forward by {diff:.2e}"


@pytest.fixture(scope="module")
def single_process(dist_pool):
    return {g: dist_pool(1).run(_gen_body, 1, 1, "tiny-qwen3", g)[0] for g in (True, False)}


@pytest.mark.parametrize("greedy", [True, False])
def test_single_process_generation(single_process, greedy):
    out = single_process[greedy]
    _check_internal(out, greedy)
    assert out["tokens"].shape[1] == 6 + 6  # longest prompt + max_new_tokens
    if greedy:  # batching with other (differently padded) prompts changes nothing
        for i, (resp, lp) in enumerate(out["singles"]):
            n = len(resp)
            assert out["tokens"][i, 6:6 + n].tolist() == resp
            batched = out["lp"][i][out["mask"][i]]
            single = lp[lp != 0]
            assert torch.allclose(batched, single, atol=1e-5)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_model_parallel_generation_matches_single_process(dist_pool, single_process, tp, pp):
    ref = single_process[True]
    for out in dist_pool(2).run(_gen_body, tp, pp, "tiny-qwen3", True):
        _check_internal(out, True)
        assert torch.equal(out["tokens"], ref["tokens"]), "every rank holds the same batch"
        assert torch.allclose(out["lp"], ref["lp"], atol=1e-5)


def _eos_body(rank, world_size):
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.rollout import MegatronRolloutEngine

    with model_parallel():
        cfg = get_preset("tiny")
        model = build_policy_model(cfg, seed=0)
        greedy = SamplingParams(max_new_tokens=5, greedy=True)
        probe = MegatronRolloutEngine(model, cfg.vocab_size, eos_id=999, pad_id=0)
        first = probe.generate(PROMPTS[:2], greedy, seed=0)
        # make the first greedy token of prompt 0 the EOS: that row stops after one token
        eos = int(first.tokens[0, first.prompt_width])
        engine = MegatronRolloutEngine(model, cfg.vocab_size, eos_id=eos, pad_id=0)
        batch = engine.generate(PROMPTS[:2], greedy, seed=0)
        return batch.response_lengths.tolist(), batch.finished.tolist(), batch.responses(), eos


def test_eos_stops_a_row_and_pads_it(dist_pool):
    lengths, finished, responses, eos = dist_pool(1).run(_eos_body)[0]
    assert lengths[0] == 1 and finished[0] is True and responses[0] == [eos]
    assert lengths[1] >= 1 and len(responses[1]) == lengths[1]
    if eos not in responses[1]:
        assert lengths[1] == 5 and finished[1] is False


def test_empty_prompts_are_rejected():
    from megatron_calibclip.rollout import MegatronRolloutEngine

    engine = MegatronRolloutEngine(torch.nn.Identity(), 10, eos_id=1, pad_id=0)
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([], SamplingParams(), seed=0)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[1], []], SamplingParams(), seed=0)


def _prefill_shapes_body(rank, world_size):
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.rollout import MegatronRolloutEngine

    with model_parallel():
        cfg = get_preset("tiny")
        model = build_policy_model(cfg, seed=0)
        shapes = []
        model.register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))
        engine = MegatronRolloutEngine(model, cfg.vocab_size, eos_id=-1, pad_id=0)
        engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=3, greedy=True), seed=0)
        return shapes, max(len(p) for p in PROMPTS[:3])


def test_prefill_materialises_only_last_position_logits(dist_pool):
    """Memory: the prefill must not hold b x prompt_len x V logits (a 32B rollout of 512
    prompts x 2k tokens x 152k vocab would need ~600 GB in fp32). megatron's static inference
    context slices the last position before the output layer; this guards that contract."""
    shapes, width = dist_pool(1).run(_prefill_shapes_body)[0]
    assert width > 1
    assert [s[:2] for s in shapes] == [(3, 1)] * 3, shapes


def _uneven_stop_body(rank, world_size):
    """DP=2, FP8 delayed scaling (its amax all-reduce spans both data-parallel ranks): every
    sequence of rank 0 ends at the first token, rank 1's run to max_new_tokens."""
    from megatron_calibclip.fp8 import FP8Recipe, precision
    from megatron_calibclip.models import build_policy_model, emulated_layer_spec, get_preset
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.rollout import MegatronRolloutEngine

    class EndsAtOnceOnRank0(MegatronRolloutEngine):  # the sampler's choice, not the stop rule, is faked
        def _choose(self, logits, params, generator, b):
            tok, lp = super()._choose(logits, params, generator, b)
            return (torch.full_like(tok, self.eos_id) if rank == 0 else tok), lp

    with model_parallel(tp=1):
        cfg = get_preset("tiny")
        model = build_policy_model(cfg, spec=emulated_layer_spec(cfg), seed=0)
        recipe = FP8Recipe(granularity="delayed", amax_history_len=4, amax_reduction="amax_group")
        forwards = []
        model.register_forward_hook(lambda m, args, out: forwards.append(1))
        engine = EndsAtOnceOnRank0(model, cfg.vocab_size, eos_id=cfg.vocab_size - 1, pad_id=0,
                                   precision=lambda: precision(model, "fp8", recipe))
        batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, greedy=True), seed=0)
        return len(forwards), batch.response_lengths.tolist(), batch.responses()


def test_decode_stop_is_agreed_across_data_parallel_ranks(dist_pool):
    """Before the agreed stop, rank 0 left the decode loop after one token while rank 1 kept
    all-reducing its amax: a hang (or mismatched collectives) in every DP>1 FP8 rollout."""
    (n0, len0, resp0), (n1, len1, resp1) = dist_pool(2).run(_uneven_stop_body, timeout=60)
    assert n0 == n1 == 5  # prefill + 4 decode forwards on both ranks
    assert len0 == [1] * len(PROMPTS) and all(r == [get_eos()] for r in resp0)
    assert all(n == 5 for n in len1)


def get_eos():
    from megatron_calibclip.models import get_preset

    return get_preset("tiny").vocab_size - 1
