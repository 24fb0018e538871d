"""megatron-calibclip: stable full-pipeline FP8 RL (GRPO/DAPO) with Calibrated Clipping."""
__version__ = "0.1.0"
