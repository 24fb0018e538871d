"""Which task does the model partly solve at step 0? Greedy and sampled accuracy per task.

Why measure: GRPO learns only from groups with mixed rewards. A task the model never solves
(all rewards 0) or always solves gives zero advantages and no gradient, so the precision arms
could not differ. The survey runs the untrained policy on held-out problems of each
candidate, greedy (what the model knows) and sampled at the rollout temperature with the
group size (the fraction of groups with mixed rewards is what GRPO can learn from).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from megatron_calibclip.parallel.devices import HOST


def _arithmetic(task: str, terms: tuple[int, int], digits: tuple[int, int]) -> dict[str, Any]:
    return {"task": task, "task_config": {"min_terms": terms[0], "max_terms": terms[1],
                                          "min_digits": digits[0], "max_digits": digits[1]}}


CANDIDATES: dict[str, dict[str, Any]] = {
    "chain_sum-1d-2t": _arithmetic("chain_sum", (2, 2), (1, 1)),
    "chain_sum-1d-2to3t": _arithmetic("chain_sum", (2, 3), (1, 1)),
    "chain_sum-1to2d-2t": _arithmetic("chain_sum", (2, 2), (1, 2)),
    "chain_sum-2d-2t": _arithmetic("chain_sum", (2, 2), (2, 2)),
    "products-1d": _arithmetic("products", (2, 2), (1, 1)),
}


def survey_task(cfg, problems: int, group_size: int) -> dict[str, float]:
    """Greedy accuracy on `problems` held-out problems; sampled accuracy and the fraction of
    groups with mixed rewards over `problems` // group_size prompts x group_size samples."""
    from megatron_calibclip.trainer.components import build_components
    from megatron_calibclip.trainer.evaluation import evaluate

    with tempfile.TemporaryDirectory() as tmp:
        c = build_components(cfg, Path(tmp))
        greedy = evaluate(c, updates=0)
        prompts = c.heldout[: max(problems // group_size, 1)]
        ids = [list(p.ids) for p in prompts for _ in range(group_size)]
        batch = c.engine.generate(ids, cfg.rollout.sampling, seed=cfg.run.seed)
        rewards = torch.tensor([c.reward_fn(c.tokenizer.decode(r), prompts[i // group_size].record)
                                for i, r in enumerate(batch.responses())], device=HOST)
    correct = (rewards >= cfg.reward.correct_threshold).float().view(-1, group_size)
    mixed = ((correct.sum(1) > 0) & (correct.sum(1) < group_size)).float().mean()
    return {"greedy_accuracy": greedy["eval/accuracy"],
            "greedy_response_length": greedy["eval/response_length_mean"],
            "sampled_accuracy": float(correct.mean()), "mixed_groups": float(mixed),
            "problems": greedy["eval/problems"]}


def run_survey(config: str, overrides: list[str], candidates: list[str], problems: int,
               group_size: int) -> dict:
    """Single process: every candidate task on the same model; JSON-ready result."""
    from megatron_calibclip.parallel import ParallelLayout, initialize_distributed, teardown
    from megatron_calibclip.trainer.config import load_train_config

    base = list(overrides) + ["parallel.tp=1", "parallel.pp=1", "run.progress=false",
                              "evaluation.every=1", f"evaluation.size={problems}",
                              "data.size=64"]  # few training problems: room for held-out ones
    cfg0 = load_train_config(config, base)
    initialize_distributed(ParallelLayout(1, 1), seed=cfg0.run.seed)
    out = {"config": config, "overrides": list(overrides), "problems": problems,
           "group_size": group_size, "precision": cfg0.rollout.precision, "tasks": {}}
    try:
        for name in candidates:
            cand = CANDIDATES[name]
            sets = [f"data.task={cand['task']}",
                    f"data.task_config={json.dumps(cand['task_config'])}"]
            t = time.perf_counter()
            res = survey_task(load_train_config(config, base + sets), problems, group_size)
            res["seconds"] = round(time.perf_counter() - t, 1)
            out["tasks"][name] = {**cand, **res}
            print(f"{name}: {res}", file=sys.stderr, flush=True)
    finally:
        teardown()
    return out
