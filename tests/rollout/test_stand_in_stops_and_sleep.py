"""What a vLLM rollout on an H100 meets that the CPU worker cannot show (issue 37, finding 10
and 8): the model's generation config names more stop tokens than its tokenizer (Qwen3's
generation_config.json: eos_token_id [151645 <|im_end|>, 151643 <|endoftext|>]; its tokenizer's
EOS is <|im_end|>), and vLLM's sleep mode, which the CPU build does not support, is driven here
through a stand-in of `LLM` with level 2's semantics (v1/worker/gpu_worker.py: the weights are
dropped, only the model's buffers kept; wake_up re-allocates them uninitialised)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from megatron_calibclip.data.tokenizers import generation_stop_ids
from megatron_calibclip.rollout import SamplingParams

pytestmark = pytest.mark.te_stand_in

IM_END, ENDOFTEXT = 151645, 151643


@pytest.mark.parametrize("listed, expected", [
    ([IM_END, ENDOFTEXT], (IM_END, ENDOFTEXT)),  # Qwen3's generation config
    (ENDOFTEXT, (IM_END, ENDOFTEXT)),  # a single int
    (None, (IM_END,)),  # no generation config: the tokenizer's EOS alone
])
def test_stand_in_stop_ids_come_from_the_generation_config(tmp_path, listed, expected):
    if listed is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
    assert generation_stop_ids(tmp_path, IM_END) == expected


def _stop_body(rank, world_size):
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.rollout import MegatronRolloutEngine

    with model_parallel():
        cfg = get_preset("tiny")
        model = build_policy_model(cfg, seed=0)
        params = SamplingParams(max_new_tokens=6, greedy=True)
        prompts = [[5, 17, 99, 3], [8, 2]]
        free = MegatronRolloutEngine(model, cfg.vocab_size, eos_id=999, pad_id=0)
        run = free.generate(prompts, params, seed=1)
        second = [r[1] for r in run.responses()]  # each row's second greedy token
        stops = MegatronRolloutEngine(model, cfg.vocab_size, eos_id=999, pad_id=0,
                                      stop_ids=second)
        stopped = stops.generate(prompts, params, seed=1)
        return run.responses(), stopped.responses(), stopped.finished.tolist()


def test_stand_in_megatron_engine_stops_on_every_stop_id(dist_pool):
    free, stopped, finished = dist_pool(1).run(_stop_body)[0]
    for row_free, row_stopped in zip(free, stopped):
        cut = row_free.index(row_free[1]) + 1  # ends at the first occurrence of a stop token
        assert row_stopped == row_free[:cut], (row_free, row_stopped)
    assert finished == [True, True]


class _SleepyLLM:
    """vLLM's LLM as sleep mode leaves it: level 2 drops the weights (wake_up gives them back
    uninitialised), level 1 keeps a host copy; generate on dropped weights is garbage, so it
    raises here."""

    def __init__(self, calls):
        self.calls, self.weights = calls, "synced"

    def sleep(self, level):
        self.calls.append(("sleep", level))
        if level == 2:
            self.weights = "dropped"

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, name, args):
        self.calls.append(("sync",))
        self.weights = "synced"
        return [{"tensors": 3}]

    def reset_prefix_cache(self):
        return True

    def generate(self, requests, sampling, use_tqdm):
        if self.weights != "synced":
            raise AssertionError("generate() on weights that sleep level 2 dropped")
        self.calls.append(("generate",))
        return []


def _engine(level, calls, monkeypatch):
    from megatron_calibclip.rollout.vllm_engine import VllmRolloutEngine
    from megatron_calibclip.rollout.vllm_settings import VllmSettings

    engine = object.__new__(VllmRolloutEngine)  # no vLLM here: its state, set by hand
    engine.settings = VllmSettings(sleep_level=level)
    engine.llm, engine.cuda, engine._stale, engine._asleep = _SleepyLLM(calls), True, False, set()
    engine.weights, engine.expected_tensors, engine.eos_id, engine.stop_ids = (
        lambda: [], 3, 2, ())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    return engine


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
@pytest.mark.parametrize("level", [1, 2])
def test_stand_in_vllm_sleep_levels_free_the_cache_first_and_never_decode_dropped_weights(
        level, monkeypatch):
    calls: list = []
    engine = _engine(level, calls, monkeypatch)
    engine._sleep()
    engine._run([[1, 2]], [], SamplingParams(), seed=0)  # nothing to do: no wake
    if engine._stale:
        engine.sync_weights()  # what generate() does first
    engine._run([[1, 2]], [0], SamplingParams(), seed=0)
    wakes = [i for i, c in enumerate(calls) if c[0] == "wake_up"]
    assert wakes and all(calls[i - 1] == ("empty_cache",) for i in wakes), calls
    assert ("generate",) in calls
    assert (("sync",) in calls) == (level == 2), calls  # level 2 re-syncs; level 1 has a copy


def test_stand_in_sleep_level_is_validated():
    from megatron_calibclip.config import ConfigError
    from megatron_calibclip.rollout.vllm_settings import VllmSettings

    assert VllmSettings().sleep_level == 2
    with pytest.raises(ConfigError, match="rollout.vllm.sleep_level"):
        VllmSettings(sleep_level=3)
