"""Planner inputs from a training config (a recipe YAML) and its `# sbatch:` header line.

Why read the YAML as a plain dict (config.load_yaml + apply_overrides) and not through
TrainConfig: the planner must stay importable and fast without the trainer's packages, and
it needs only a dozen fields. The GPU count is not part of a TrainConfig; recipes carry it
in a header comment that launch/submit.sh also reads:

    # sbatch: --nodes=4 --gpus-per-node=8 --time=24:00:00

What the trainer does today fixes the rest: no sequence parallelism, no activation
recomputation (models/builder.py), FP32 gradient reduction (trainer/components.py), a KV
cache in the parameters' dtype (megatron allocates it from the K/V tensors).
"""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megatron_calibclip.config import ConfigError, apply_overrides, load_yaml
from megatron_calibclip.planner.spec import Layout, Workload

DEFAULTS = {  # TrainConfig defaults for the fields read here (trainer/config.py)
    "max_prompt_tokens": 256, "max_new_tokens": 64, "micro_batch_size": 8,
    "logprob_micro_batch_size": 16, "prompts_per_step": 8, "group_size": 8, "mini_batches": 2,
}


@dataclass(frozen=True)
class RecipePlan:
    path: str
    preset: str  # model preset
    nodes: int
    gpus_per_node: int
    sbatch_args: list[str]  # the header's sbatch options, as launch/submit.sh passes them
    layout: Layout
    workload: Workload

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def sbatch_header(path: str | Path) -> list[str]:
    """The options of the first `# sbatch:` line of a recipe ([] if there is none)."""
    for line in Path(path).read_text().splitlines():
        match = re.match(r"^#\s*sbatch:\s*(.*)$", line)
        if match:
            return shlex.split(match.group(1))
    return []


def _option(args: Sequence[str], *names: str, default: int | None = None) -> int | None:
    for i, a in enumerate(args):
        for n in names:
            if a.startswith(n + "="):
                return int(a.split("=", 1)[1])
            if a == n and i + 1 < len(args):
                return int(args[i + 1])
    return default


def _get(cfg: dict, dotted: str, default):
    node = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def read_recipe(path: str | Path, overrides: Sequence[str] = ()) -> RecipePlan:
    cfg = apply_overrides(load_yaml(path), list(overrides))
    args = sbatch_header(path)
    nodes = _option(args, "--nodes", "-N", default=1)
    per_node = _option(args, "--gpus-per-node", "--ntasks-per-node", default=8)
    gpus = nodes * per_node
    tp, pp = int(_get(cfg, "parallel.tp", 1)), int(_get(cfg, "parallel.pp", 1))
    if gpus % (tp * pp):
        raise ConfigError(f"{path}: {gpus} GPUs ({nodes} nodes x {per_node}) are not "
                          f"divisible by TP x PP = {tp} x {pp}")
    dp = gpus // (tp * pp)
    alg = lambda k: int(_get(cfg, f"algorithm.{k}", DEFAULTS[k]))  # noqa: E731
    prompts, group = alg("prompts_per_step"), alg("group_size")
    prompt_len = int(_get(cfg, "data.max_prompt_tokens", DEFAULTS["max_prompt_tokens"]))
    response = int(_get(cfg, "rollout.sampling.max_new_tokens", DEFAULTS["max_new_tokens"]))
    micro = alg("micro_batch_size")
    per_rank = prompts * group // alg("mini_batches") / dp
    precision = str(_get(cfg, "precision", "fp8"))
    # a recipe runs on GPUs, where params_dtype `auto` is bf16 (trainer/config.py)
    params = str(_get(cfg, "model.params_dtype", "auto"))
    params = "bf16" if params == "auto" else params
    reference = str(_get(cfg, "model.reference_dtype", "bf16"))
    for field, value in (("model.params_dtype", params), ("model.reference_dtype", reference)):
        if value not in ("bf16", "fp32"):
            raise ConfigError(f"{path}: {field} {value!r} is not one of bf16, fp32 (or auto)")
    layout = Layout(
        tp=tp, pp=pp, dp=dp, sequence_parallel=False, recompute="none",
        distributed_optimizer=bool(_get(cfg, "optimizer.distributed", False)) and dp > 1,
        offload_reference=bool(_get(cfg, "model.offload_reference", False)),
        precision="fp8" if precision == "fp8" else "bf16",
        params_dtype=params, reference_dtype=reference,
        kv_cache_dtype=params,  # megatron sizes the KV cache from the K/V dtype
        rollout_engine=str(_get(cfg, "rollout.engine", "megatron")),
        engine_memory_fraction=float(_get(cfg, "rollout.vllm.gpu_memory_utilization", 0.35)),
        engine_sleeps=bool(_get(cfg, "rollout.vllm.sleep_between_rollouts", True)),
        # fp8: one byte per weight (scales are ~1/16384 of that with 128x128 blocks)
        engine_weight_bytes=1.0 if str(_get(cfg, "rollout.precision", "fp8")) == "fp8" else 2.0,
        optimizer_format=str(_get(cfg, "optimizer.checkpoint_format", "dp_reshardable")))
    workload = Workload(
        seq_len=prompt_len + response, prompt_len=prompt_len, micro_batch=micro,
        logprob_micro_batch=alg("logprob_micro_batch_size"),
        rollout_batch=math.ceil(prompts / dp) * group,
        microbatches_per_step=max(1, math.ceil(per_rank / micro)))
    return RecipePlan(str(path), str(_get(cfg, "model.preset", "tiny")), nodes, per_node,
                      args, layout, workload)
