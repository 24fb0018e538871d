"""Held-out evaluation in a chosen precision (evaluation.precision) and decoded response
samples (samples.jsonl), through the real trainer at DP=2 on the tiny config.

The reference for the evaluation is an independent run: an FP8 arm evaluated in BF16 must
decode exactly what a run whose rollout *is* BF16 decodes from the same weights (step 0, after
the same warm-up in the same trainer precision). The samples are re-scored from their text."""
from __future__ import annotations

import json

import pytest
import torch

from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

CFG = merge(TINY_TRAIN, {
    "parallel": {"tp": 1},
    "run": {"tensorboard": False, "plot": False, "steps": 2, "checkpoint": False},
    "clipping": {"mode": "fixed"},
    "evaluation": {"every": 1, "size": 24},
})
ARMS = {  # rollout precision, evaluation precision
    "fp8-eval-bf16": {"rollout": {"precision": "fp8"}, "evaluation": {"precision": "bf16"},
                      "samples": {"count": 100}},
    "bf16-rollout": {"rollout": {"precision": "bf16"}, "samples": {"every": 0}},
    "fp8-eval-rollout": {"rollout": {"precision": "fp8"}, "samples": {"every": 0}},
}


def _train(rank, world_size, cfg_dict):
    """Records, plus the tokens of every held-out decode and the held-out / training problems."""
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train
    import megatron_calibclip.trainer.evaluation as evaluation

    from megatron_calibclip.fp8 import get_precision

    decoded, seen = [], {"modes": set()}
    real = evaluation.evaluation_engine

    class Recorder:  # the decoded tokens, and the policy's precision in each of its forwards
        def __init__(self, engine, policy):
            self.engine, self.policy = engine, policy

        def generate(self, prompts, params, seed):
            hook = self.policy.register_forward_pre_hook(
                lambda module, args: seen["modes"].add(get_precision(module).mode))
            try:
                batch = self.engine.generate(prompts, params, seed)
            finally:
                hook.remove()
            decoded.append(batch.tokens.clone())
            return batch

    def spy(c):
        seen["train"] = [(p.text, p.record) for p in c.dataset.items]
        return Recorder(real(c), c.policy)

    evaluation.evaluation_engine = spy
    try:
        records = train(from_dict(TrainConfig, cfg_dict))["records"]
    finally:
        evaluation.evaluation_engine = real
    return records, decoded, seen


@pytest.fixture(scope="module")
def runs(dist_pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_precision")
    results = {}
    for name, arm in ARMS.items():
        cfg = merge(merge(CFG, arm), {"run": {"name": name, "output_dir": str(out)}})
        results[name] = dist_pool(2).run(_train, cfg, timeout=600)
    return out, results


def _training_numbers(record):
    skip = ("time/", "eval")
    return {k: ("nan" if isinstance(v, float) and v != v else v)
            for k, v in record.items() if not k.startswith(skip)}


def test_an_fp8_arm_evaluated_in_bf16_decodes_what_a_bf16_rollout_decodes(runs):
    _, results = runs
    (fp8_bf16, dec_a, _), _ = results["fp8-eval-bf16"]
    (bf16, dec_b, _), _ = results["bf16-rollout"]
    (fp8, dec_c, _), _ = results["fp8-eval-rollout"]
    # before step 0 the weights are identical (same warm-up, same trainer precision)
    assert torch.equal(dec_a[0], dec_b[0])
    assert fp8_bf16[0]["eval/accuracy"] == bf16[0]["eval/accuracy"]
    # every forward of the held-out decode ran in the evaluation precision
    assert results["fp8-eval-bf16"][0][2]["modes"] == {"bf16"}
    assert results["fp8-eval-rollout"][0][2]["modes"] == {"fp8"}
    assert [r["eval/precision"] for r in fp8_bf16 if "eval/precision" in r] == ["bf16", "bf16"]
    assert fp8_bf16[-1]["eval_final/precision"] == "bf16"
    assert [r.get("eval/precision") for r in fp8] == ["fp8", "fp8"]  # "rollout" resolved
    assert bf16[0]["eval/precision"] == "bf16"
    # the measurement never changes training: the same rollout precision trains identically
    assert [_training_numbers(r) for r in fp8_bf16] == [_training_numbers(r) for r in fp8]


def test_samples_are_rank0s_decoded_responses_with_their_reward_and_advantage(runs):
    from megatron_calibclip.rl import ReasoningGymReward

    out, results = runs
    (_, _, seen), _ = results["fp8-eval-bf16"]
    assert not (out / "bf16-rollout" / "samples.jsonl").exists()  # samples.every: 0
    lines = (out / "fp8-eval-bf16" / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    samples = [json.loads(line) for line in lines]
    group_size, per_rank = TINY_TRAIN["algorithm"]["group_size"], TINY_TRAIN["algorithm"]["prompts_per_step"] // 2
    # count 100 > rank 0's share: all of it, round-robin over its prompts, on both steps
    assert [s["step"] for s in samples] == [0] * group_size * per_rank + [1] * group_size * per_rank
    assert [(s["group"], s["sample"]) for s in samples[:4]] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    problems = dict(seen["train"])
    scorer = ReasoningGymReward(extraction="final_answer")
    max_new = TINY_TRAIN["rollout"]["sampling"]["max_new_tokens"]
    for s in samples:
        assert set(s) >= {"step", "prompt", "response", "reward", "advantage", "eos", "length"}
        assert s["prompt"] in problems  # decoded with the run's tokenizer: the prompt it saw
        assert s["reward"] == float(scorer(s["response"], problems[s["prompt"]].entry))
        assert s["eos"] or s["length"] == max_new  # not ended: cut at max_new_tokens
    for step in (0, 1):
        for g in range(per_rank):
            group = [s for s in samples if s["step"] == step and s["group"] == g]
            rewards = torch.tensor([s["reward"] for s in group], dtype=torch.float64)
            adv = torch.tensor([s["advantage"] for s in group], dtype=torch.float64)
            expected = (torch.zeros_like(rewards) if rewards.max() == rewards.min()
                        else (rewards - rewards.mean()) / (rewards.std() + 1e-6))
            assert torch.allclose(adv, expected, atol=1e-5), (step, g)
