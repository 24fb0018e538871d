"""One update at DP=1 and DP=2 on the same global batch: same loss and gradients."""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.dist

GLOBAL = 8  # sequences in the global batch


def _cfg(agg):
    from megatron_calibclip.config import from_dict
    from megatron_calibclip.trainer import TrainConfig

    return from_dict(TrainConfig, {
        "run": {"steps": 1, "progress": False, "tensorboard": False, "plot": False},
        "model": {"preset": "tiny"},
        "data": {"size": 16, "tokenizer": "train:160", "template": "{prompt}",
                 "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                 "max_digits": 1}},
        "algorithm": {"group_size": 4, "prompts_per_step": 2, "mini_batches": 1,
                      "micro_batch_size": 2, "logprob_micro_batch_size": 3},
        "loss": {"loss_agg_mode": agg, "kl_coef": 0.01},
        "clipping": {"mode": "fixed"},
        "precision": "fp32", "rollout": {"precision": "fp32"},
    })


def _global_batch(vocab, pad_id):
    """A fixed global batch: 4 left-padded prompts x 2, responses of various lengths."""
    from megatron_calibclip.rollout import RolloutBatch

    g = torch.Generator().manual_seed(0)
    P, R = 6, 5
    tokens = torch.randint(3, vocab, (GLOBAL, P + R), generator=g)
    prompt_len = torch.tensor([6, 4, 5, 6, 3, 6, 6, 2])
    resp_len = torch.tensor([5, 3, 1, 4, 5, 2, 5, 3])
    for i in range(GLOBAL):
        tokens[i, : P - prompt_len[i]] = pad_id
        tokens[i, P + resp_len[i]:] = pad_id
    rollout_lp = -torch.rand(GLOBAL, P + R - 1, generator=g) * 3
    batch = RolloutBatch(tokens, P, prompt_len, resp_len, resp_len < R, rollout_lp, pad_id)
    rollout_lp *= batch.response_mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    return batch, rewards


def _update_body(rank, world_size, agg, out_dir):
    from megatron_calibclip.parallel import initialize_distributed
    from megatron_calibclip.rl import grpo_advantages
    from megatron_calibclip.trainer.components import build_components
    from megatron_calibclip.trainer.step import StepData, Timer, update_policy
    from tests.dist_utils import full_state

    cfg = _cfg(agg)
    initialize_distributed(seed=0)
    from pathlib import Path

    c = build_components(cfg, Path(out_dir) / f"w{world_size}")
    batch, rewards = _global_batch(c.model_cfg.vocab_size, c.tokenizer.pad_id)
    adv = grpo_advantages(rewards, group_size=4)
    idx = torch.arange(GLOBAL)[c.dp_rank::c.dp_size]  # this replica's share
    data = StepData(batch.select(idx), rewards[idx], adv[idx].float(),
                    batch.select(idx).response_mask, 1)
    stats = update_policy(c, data, 0, 0.8, 1.2, False, Timer())
    grads = full_state(c.policy, c.model_cfg.num_layers, c.model_cfg.vocab_size, grads=True)
    return stats["loss/total"], stats["grad_norm"], grads, stats["loss/kl_mean"]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_one_step_same_at_dp1_and_dp2(dist_pool, tmp_path, agg):
    loss1, norm1, grads1, kl1 = dist_pool(1).run(_update_body, agg, str(tmp_path))[0]
    results = dist_pool(2).run(_update_body, agg, str(tmp_path))
    for loss2, norm2, grads2, kl2 in results:
        assert abs(loss2 - loss1) <= 1e-6 * max(1.0, abs(loss1)), (loss1, loss2)
        assert abs(norm2 - norm1) <= 1e-5 * norm1, (norm1, norm2)
        assert abs(kl2 - kl1) <= 1e-7
        worst = max(float(np.abs(grads2[k] - grads1[k]).max()) for k in grads1)
        assert worst <= 1e-6, f"gradients differ by {worst:.3g}"
    assert norm1 > 0 and abs(loss1) > 0
