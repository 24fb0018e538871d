"""Helpers for the checkpoint tests' distributed bodies (run inside pool workers)."""
from __future__ import annotations

import numpy as np
import torch


def build_trainable(cfg, seed: int, lr: float = 1e-2, distributed: bool = False):
    """Tiny GPTModel + megatron DDP + megatron Adam with gradient clipping, as the trainer;
    distributed: megatron's distributed optimizer (states sharded over DP)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_calibclip.models import build_policy_model

    model = build_policy_model(cfg, seed=seed)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=distributed),
        model)
    model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, clip_grad=1.0, bf16=False,
                        use_distributed_optimizer=distributed), [ddp])
    return model, ddp, optimizer


def logits_any_layout(model, tokens: torch.Tensor, vocab_size: int):
    """Full-vocabulary logits [b, s, vocab] (numpy) on the last pipeline stage, else None."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_calibclip.models import position_ids_for
    from tests.dist_utils import gather_vocab

    def step(data_iterator, m):
        t = next(data_iterator)
        out = m(t, position_ids_for(t), None)

        def loss_func(output, non_loss_data=False):
            return output

        return out, loss_func

    with torch.no_grad():
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            logits = model(tokens, position_ids_for(tokens), None)
        else:
            b, s = tokens.shape
            res = get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter([tokens]), model=[model],
                num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True,
                collect_non_loss_data=True)
            if not parallel_state.is_pipeline_last_stage():
                return None
            logits = res[0]
    return gather_vocab(logits, vocab_size)


def first_not_none(values):
    found = [v for v in values if v is not None]
    assert found, "no rank returned a value"
    return found[0]


def max_abs_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())
