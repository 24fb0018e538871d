"""Generation for RL rollouts (floor 2): sampling, KV-cached megatron engine, batch layout."""
from megatron_calibclip.rollout.batch import RolloutBatch
from megatron_calibclip.rollout.engine import MegatronRolloutEngine, RolloutEngine
from megatron_calibclip.rollout.sampling import SamplingParams, sample_next

__all__ = ["MegatronRolloutEngine", "RolloutBatch", "RolloutEngine", "SamplingParams",
           "sample_next"]
