"""Everything one training run needs, built from a TrainConfig (the only place that composes
models, FP8, rollout, data, rewards, optimizer and calibration)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_calibclip.calibration import CalibratedClipper
from megatron_calibclip.config import ConfigError
from megatron_calibclip.data import (
    PromptDataset,
    SkipCounter,
    load_tokenizer,
    read_jsonl,
    reasoning_gym_records,
    train_sentencepiece,
)
from megatron_calibclip.fp8 import precision, set_precision
from megatron_calibclip.models import (
    ModelConfig,
    build_policy_model,
    build_reference_model,
    copy_weights,
    get_preset,
    place_on_device,
)
from megatron_calibclip.parallel.devices import HOST, compute_device, model_device
from megatron_calibclip.rl import ReasoningGymReward, math_reward
from megatron_calibclip.rollout import RolloutEngine
from megatron_calibclip.trainer.config import TrainConfig
from megatron_calibclip.trainer.rollout_factory import build_rollout_engine
from megatron_calibclip.trainer.te_run import prepare_te_model, trainer_backend, trainer_layer_spec


@dataclass
class Components:
    cfg: TrainConfig
    model_cfg: ModelConfig
    policy: torch.nn.Module  # the GPTModel stage (precision switch lives on it)
    ddp: DistributedDataParallel  # what the schedule and the optimizer see
    optimizer: Any  # megatron optimizer
    reference: torch.nn.Module  # frozen BF16 reference model
    engine: RolloutEngine  # rollout.engine: megatron or vllm (trainer/rollout_factory.py)
    tokenizer: Any
    dataset: PromptDataset
    skips: SkipCounter
    clipper: Optional[CalibratedClipper]  # None with fixed clipping
    reward_fn: Callable[[str, Any], float]
    dp_rank: int
    dp_size: int
    dp_group: Any
    run_dir: Path
    heldout: list = field(default_factory=list)  # held-out prompts (evaluation.every > 0)

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters live: batches, rewards and sampling go there."""
        return model_device(self.policy)

    def trainer_precision(self):
        """Context manager: the policy in the trainer precision."""
        return precision(self.policy, self.cfg.precision, self.cfg.fp8)

    def shadow_precision(self):
        """Context manager: the policy in the shadow precision (BF16 by default), same weights."""
        return precision(self.policy, self.cfg.clipping.calibration.shadow_precision)


def _model_config(cfg: TrainConfig) -> ModelConfig:
    """The preset (with overrides), or the architecture recorded in `model.load`'s checkpoint."""
    if cfg.model.load is None:
        return get_preset(cfg.model.preset, **cfg.model.overrides)
    from megatron_calibclip.checkpoint import CheckpointInfo
    from megatron_calibclip.checkpoint.layout import resolve_checkpoint

    recorded = CheckpointInfo.read(resolve_checkpoint(cfg.model.load)).model()
    if recorded is None:
        return get_preset(cfg.model.preset, **cfg.model.overrides)
    if cfg.model.overrides:
        return get_preset(cfg.model.preset, **{**dataclasses.asdict(recorded),
                                               **cfg.model.overrides})
    return recorded


def _tokenizer(cfg: TrainConfig, records, run_dir: Path):
    spec = cfg.data.tokenizer
    if spec.startswith("train:"):
        try:
            size = int(spec.split(":", 1)[1])
        except ValueError as err:
            raise ConfigError(f"data.tokenizer {spec!r}: expected train:N") from err
        texts = [f"{r.prompt} {r.answer}" for r in records]
        # every rank trains the same model from the same texts (deterministic); rank-local
        # file so that ranks never read a half-written file
        path = train_sentencepiece(texts, run_dir / "tokenizer" / f"sp{dist.get_rank()}",
                                   vocab_size=size)
        return load_tokenizer(path)
    return load_tokenizer(spec)


def _records(cfg: TrainConfig, skips: SkipCounter):
    d = cfg.data
    if d.source == "jsonl":
        return read_jsonl(d.path, prompt_key=d.prompt_key, answer_key=d.answer_key,
                          on_bad=d.on_bad, skips=skips)
    return reasoning_gym_records(d.task, d.size, seed=cfg.run.seed, **d.task_config)


def _reward_fn(cfg: TrainConfig):
    kind = cfg.reward.kind
    if kind == "auto":
        kind = "reasoning_gym" if cfg.data.source == "reasoning_gym" else "math"
    if kind == "reasoning_gym":
        scorer = ReasoningGymReward(extraction=cfg.reward.extraction)
        return lambda text, record: float(scorer(text, record.entry))
    return lambda text, record: float(math_reward(text, record.answer))


def build_components(cfg: TrainConfig, run_dir: Path) -> Components:
    """Build models, optimizer, data, rollout engine and clipper on this rank."""
    if (cfg.run.checkpoint and cfg.optimizer.distributed and not torch.cuda.is_available()
            and cfg.optimizer.checkpoint_format != "dp_reshardable"):
        raise ConfigError(
            f"optimizer.checkpoint_format: {cfg.optimizer.checkpoint_format} does not work on "
            f"CPU with optimizer.distributed (megatron-core 0.16.x and 0.19.x gather it through "
            f"CUDA, and its loader does not fit torch's Adam); use dp_reshardable (the default), "
            f"optimizer.distributed=false or run.checkpoint=false")
    model_cfg = _model_config(cfg)
    dp_size = ps.get_data_parallel_world_size()
    if cfg.algorithm.prompts_per_step % dp_size:
        raise ConfigError(f"algorithm.prompts_per_step ({cfg.algorithm.prompts_per_step}) must be "
                          f"divisible by the data-parallel size ({dp_size})")
    skips = SkipCounter()
    records = _records(cfg, skips)
    tokenizer = _tokenizer(cfg, records, run_dir)
    if cfg.model.load is None and tokenizer.vocab_size != model_cfg.vocab_size:
        # a randomly initialised model takes its vocabulary size from the tokenizer
        model_cfg = get_preset(cfg.model.preset,
                               **{**cfg.model.overrides, "vocab_size": tokenizer.vocab_size})
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is "
                          f"{model_cfg.vocab_size}")
    dataset = PromptDataset(records, tokenizer, template=cfg.data.prompt_template(),
                            max_prompt_tokens=cfg.data.max_prompt_tokens,
                            on_too_long=cfg.data.on_bad, seed=cfg.run.seed, skips=skips)

    heldout = []
    if cfg.evaluation.every:
        from megatron_calibclip.trainer.evaluation import heldout_prompts

        heldout = heldout_prompts(cfg, records, tokenizer)

    spec = trainer_layer_spec(cfg.fp8, model_cfg)  # megatron's TE spec, or ours (te_run.py)
    bf16_params = cfg.model.resolved_params_dtype() == "bf16"
    device = compute_device()
    # with model.load the weights come next: no rank draws an init to overwrite
    loads = cfg.model.load is not None
    policy = build_policy_model(model_cfg, spec=spec, seed=None if loads else cfg.run.seed,
                                initialize=not loads,
                                params_dtype=torch.bfloat16 if bf16_params else torch.float32,
                                calculate_per_token_loss=True)
    # on the device right after building, before DDP and the optimizer (Megatron-LM's
    # get_model); megatron builds some weights without a device (WrappedTorchNorm's)
    place_on_device(policy, device)
    policy.config.finalize_model_grads_func = finalize_model_grads
    if cfg.model.load is not None:
        from megatron_calibclip.checkpoint import load_weights

        load_weights(cfg.model.load, policy)  # converted HF weights or an earlier run
    ref_dtype = torch.bfloat16 if cfg.model.reference_dtype == "bf16" else torch.float32
    reference = place_on_device(  # no init of its own: the policy's weights are copied in
        build_reference_model(model_cfg, dtype=ref_dtype, spec=spec, initialize=False), device)
    copy_weights(policy, reference)
    set_precision(reference, "bf16" if ref_dtype == torch.bfloat16 else "fp32")
    set_precision(policy, cfg.precision, cfg.fp8)
    if trainer_backend(cfg.fp8) == "te":
        prepare_te_model(policy, cfg.fp8, cfg.parallel.tp)
    if cfg.model.offload_reference and device.type != "cpu":
        place_on_device(reference, HOST)  # visits the GPU only for its forward (step.py)

    ddp = DistributedDataParallel(
        policy.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=cfg.optimizer.distributed),
        policy,
    )
    o = cfg.optimizer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=o.lr, weight_decay=o.weight_decay,
                        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                        clip_grad=o.clip_grad, bf16=bf16_params, fp16=False,
                        use_distributed_optimizer=o.distributed),
        [ddp],
    )
    engine = build_rollout_engine(cfg, model_cfg, policy, tokenizer)
    clipper = None
    if cfg.clipping.mode == "calibrated":
        clipper = CalibratedClipper(cfg.clipping.calibration, eps_low=cfg.loss.eps_low,
                                    eps_high=cfg.loss.eps_high,
                                    dual_clip_c=cfg.loss.dual_clip_c if cfg.loss.dual_clip else None)
    return Components(
        cfg=cfg, model_cfg=model_cfg, policy=policy, ddp=ddp, optimizer=optimizer,
        reference=reference, engine=engine, tokenizer=tokenizer, dataset=dataset, skips=skips,
        clipper=clipper, reward_fn=_reward_fn(cfg), dp_rank=ps.get_data_parallel_rank(),
        dp_size=dp_size, dp_group=ps.get_data_parallel_group(), run_dir=run_dir,
        heldout=heldout,
    )
