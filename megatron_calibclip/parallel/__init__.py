"""Process groups and vocab-parallel math (floor 1).

`initialize_distributed` starts torch.distributed (NCCL with CUDA, gloo without) from torchrun
or SLURM variables and creates megatron-core's TP/PP/CP/DP groups; `teardown` undoes it.
"""
from megatron_calibclip.parallel.env import DistEnv, DistributedEnvError, read_dist_env
from megatron_calibclip.parallel.flags import any_rank
from megatron_calibclip.parallel.initialize import (
    ParallelLayout,
    ParallelLayoutError,
    default_backend,
    initialize_distributed,
    initialize_model_parallel,
    model_parallel,
    teardown,
    teardown_model_parallel,
)
from megatron_calibclip.parallel.slurm import expand_nodelist, first_host
from megatron_calibclip.parallel.vocab_parallel import (
    dense_logprobs_entropy,
    vocab_parallel_logprobs_entropy,
)

__all__ = [
    "DistEnv",
    "DistributedEnvError",
    "ParallelLayout",
    "ParallelLayoutError",
    "any_rank",
    "default_backend",
    "dense_logprobs_entropy",
    "expand_nodelist",
    "first_host",
    "initialize_distributed",
    "initialize_model_parallel",
    "model_parallel",
    "read_dist_env",
    "teardown",
    "teardown_model_parallel",
    "vocab_parallel_logprobs_entropy",
]
