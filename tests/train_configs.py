"""The small training config that the trainer and checkpoint tests start from, and a deep merge."""
from __future__ import annotations

TINY_TRAIN = {
    "run": {"steps": 4, "progress": False, "tensorboard": True, "plot": True, "seed": 1},
    "model": {"preset": "tiny"},
    "data": {"source": "reasoning_gym", "task": "chain_sum", "size": 32,
             "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
             "tokenizer": "train:160", "template": "{prompt}", "max_prompt_tokens": 64},
    "rollout": {"precision": "fp8", "sampling": {"max_new_tokens": 3}},
    "algorithm": {"group_size": 4, "prompts_per_step": 4, "mini_batches": 2,
                  "micro_batch_size": 4, "logprob_micro_batch_size": 8},
    "clipping": {"mode": "calibrated", "calibration": {"period": 2}},
    "optimizer": {"lr": 1e-3},
    "warmup": {"steps": 3, "prompts_per_step": 8},
    "precision": "fp8",
    "fp8": {"format": "hybrid", "granularity": "tensorwise"},
}


def merge(base: dict, override: dict) -> dict:
    """A copy of `base` with `override` merged in, recursively for nested sections."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return out
