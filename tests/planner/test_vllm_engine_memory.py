"""The planner with rollout.engine: vllm: the engine's weights (every layer at the trainer's
TP, rollout dtype) and KV cache must fit in the share vLLM reserves; the share is the
generation phase, and stays resident in every phase without sleep mode."""
from dataclasses import replace

import pytest

from megatron_calibclip.models import get_preset
from megatron_calibclip.planner.memory import estimate
from megatron_calibclip.planner.params import stage_params
from megatron_calibclip.planner.spec import GIB, Hardware, Layout, Workload

M = get_preset("qwen3-8b")
W = Workload(seq_len=4096, prompt_len=1024, rollout_batch=64)
VLLM = Layout(tp=4, pp=2, dp=1, rollout_engine="vllm", engine_memory_fraction=0.2,
              engine_weight_bytes=1.0)


def test_engine_weights_and_kv_by_hand():
    s = estimate(M, VLLM, W).stages[0]
    d = M.head_dim
    assert s.engine_weights == stage_params(M, 4, 1, 0).total  # all layers, 1 byte each
    # K and V, every layer, 8 KV groups / TP 4, 64 / PP 2 sequences of 4096 tokens, bf16
    assert s.kv_cache == 2 * M.num_layers * (M.num_query_groups // 4) * d * 2 * 32 * 4096
    assert s.engine_share == s.generation == 0.2 * Hardware().gpu_memory_gib * GIB
    assert s.engine_fits


def test_a_share_too_small_does_not_fit():
    e = estimate(M, replace(VLLM, engine_memory_fraction=0.05), W)
    assert not e.worst.engine_fits and not e.fits
    assert e.headroom_gib > 0  # it is the engine's share, not the GPU, that is short


def test_without_sleep_the_share_is_resident_in_every_phase():
    awake = estimate(M, replace(VLLM, engine_sleeps=False), W).stages[0]
    asleep = estimate(M, VLLM, W).stages[0]
    assert awake.update - asleep.update == pytest.approx(awake.engine_share)
    assert awake.logprobs - asleep.logprobs == pytest.approx(awake.engine_share)


def test_megatron_engine_unchanged():
    s = estimate(M, replace(VLLM, rollout_engine="megatron"), W).stages[0]
    assert s.engine_share == 0 and s.engine_weights == 0 and s.engine_fits
