"""Memory planner for RL training layouts on H100s (floor 5: a tool beside the CLI).

Small modules, one job each: `spec` (typed inputs), `params` (parameters per GPU and
stage), `states` (weights/gradients/optimizer/FP8 caches/reference bytes), `activations`
(per-layer saved tensors, recomputation, pipeline in-flight), `rollout` (KV cache, prefill
logits), `memory` (phases and peak per stage), `search` (layouts, fit, recommendation),
`recipe` (inputs from a recipe YAML), `crosscheck` (published figures), `report` and `cli`.
It reads model architecture from models.config and nothing else from the trainer. See
docs/planner.md.
"""
from megatron_calibclip.planner.memory import Estimate, StageMemory, estimate
from megatron_calibclip.planner.search import plan, recommend
from megatron_calibclip.planner.spec import Hardware, Layout, Workload

__all__ = ["Estimate", "Hardware", "Layout", "StageMemory", "Workload", "estimate", "plan",
           "recommend"]
