"""The RL trainer (floor 4): the only package that composes models, FP8, rollout, rewards,
calibration and the optimizer. `calibclip train --config F` runs `trainer.loop.train`."""
from megatron_calibclip.trainer.config import TrainConfig
from megatron_calibclip.trainer.loop import train

__all__ = ["TrainConfig", "train"]
