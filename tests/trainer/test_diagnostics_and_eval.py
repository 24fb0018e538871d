"""Measurements that must never change training: BF16 shadow diagnostics on every step
(diagnostics.shadow_every), held-out greedy evaluation (evaluation.every) and response samples
(samples.every), through the real trainer at DP=2."""
from __future__ import annotations

import pytest
import torch

from tests.train_configs import TINY_TRAIN, merge

pytestmark = pytest.mark.dist

CFG = merge(TINY_TRAIN, {
    "parallel": {"tp": 1},
    "run": {"tensorboard": False, "plot": False, "steps": 3, "checkpoint": False},
    "clipping": {"mode": "fixed"},
    "data": {"task_config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}},
})


def _train(rank, world_size, cfg_dict):
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig, train
    import megatron_calibclip.trainer.loop as loop

    params = {}
    real = loop.train_step

    def spy(c, step, **kw):
        out = real(c, step, **kw)
        params["p"] = [p.detach().clone() for p in c.policy.parameters()]
        params["heldout"] = [p.text for p in c.heldout]
        params["train"] = {p.record.prompt for p in c.dataset.items}
        return out

    loop.train_step = spy
    try:
        records = train(from_dict(TrainConfig, cfg_dict))["records"]
    finally:
        loop.train_step = real
    return records, params


def _training_numbers(record):
    """What training computes (not the added measurements, not timings)."""
    skip = ("time/", "eval", "loss/phantom", "loss/shadow")
    return {k: ("nan" if isinstance(v, float) and v != v else v)
            for k, v in record.items() if not k.startswith(skip)}


def test_shadow_diagnostics_and_evaluation_leave_training_unchanged(dist_pool, tmp_path):
    plain = merge(CFG, {"run": {"name": "plain", "output_dir": str(tmp_path)}, "samples": {"every": 0}})
    measured = merge(CFG, {"run": {"name": "measured", "output_dir": str(tmp_path)},
                           "diagnostics": {"shadow_every": 1},
                           "evaluation": {"every": 2, "size": 24}})
    (base, base_p), _ = dist_pool(2).run(_train, plain, timeout=600)
    (meas, meas_p), (meas1, _) = dist_pool(2).run(_train, measured, timeout=600)
    # training is bit-identical with the measurements on (response samples too: default 4 per step)
    assert not (tmp_path / "plain" / "samples.jsonl").exists()
    assert (tmp_path / "measured" / "samples.jsonl").read_text().count("\n") == 4 * 3
    assert [_training_numbers(r) for r in base] == [_training_numbers(r) for r in meas]
    assert all(torch.equal(a, b) for a, b in zip(base_p["p"], meas_p["p"]))
    # the shadow counterfactual on every step, also with fixed clipping
    for r in meas:
        assert 0.0 <= r["loss/phantom_clipfrac"] <= r["loss/clipfrac_lower"] <= 1.0
        assert 0.0 <= r["loss/shadow_clipfrac_lower"] <= 1.0
        assert r["time/shadow"] > 0
    assert all("loss/phantom_clipfrac" not in r for r in base)
    # evaluations before steps 0 and 2, and after the last step
    assert [r.get("eval/updates") for r in meas] == [0.0, None, 2.0]
    assert meas[-1]["eval_final/updates"] == 3.0
    for key in ("eval/accuracy", "eval_final/accuracy"):
        r = meas[-1]
        assert r[key.replace("accuracy", "problems")] == 24.0
        assert 0.0 <= r[key] <= 1.0 and (r[key] * 24).is_integer()
    assert [r.get("eval/accuracy") for r in meas] == [r.get("eval/accuracy") for r in meas1]
    # held-out problems: the requested number, none of them a training problem
    heldout, train_prompts = meas_p["heldout"], meas_p["train"]
    assert len(heldout) == len(set(heldout)) == 24
    assert not any(any(t in h for t in train_prompts) for h in heldout)


def test_evaluation_refuses_a_task_without_enough_unseen_problems(tmp_path):
    from megatron_calibclip.config import ConfigError, from_dict
    from megatron_calibclip.data import reasoning_gym_records
    from megatron_calibclip.trainer import TrainConfig
    from megatron_calibclip.trainer.evaluation import heldout_prompts

    small = merge(CFG, {"data": {"task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                 "max_digits": 1}, "size": 400},
                        "evaluation": {"every": 1, "size": 100}})
    cfg = from_dict(TrainConfig, small)
    records = reasoning_gym_records("chain_sum", 400, seed=1, **small["data"]["task_config"])
    with pytest.raises(ConfigError, match="evaluation.size: 100 held-out problems wanted"):
        heldout_prompts(cfg, records, tokenizer=None)
