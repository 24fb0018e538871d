"""The trainer on megatron-core's Transformer Engine path (`fp8.backend: te`, or `auto` with
CUDA and TE): which layer spec a run builds, what must hold before it starts, and what the
built models carry.

Why here and not in fp8/: the decision needs the whole TrainConfig (params dtype, rollout
engine, both FP8 sections), and it is the trainer that builds the models. What is decided:
- policy and reference are built from megatron's TE spec (models.te_layer_spec); FP8 on and
  off is `config.fp8` on the shared TransformerConfig (fp8.precision -> fp8/te.py), read by
  megatron's own FP8 context (fp8_utils.get_fp8_context) in TransformerBlock.forward. The
  BF16 shadow pass is the same module with the context off; the reference never has FP8.
- parameters are BF16 (megatron's Float16Optimizer keeps fp32 main parameters): TE's
  "FP8 off" GEMMs run in the parameters' dtype, which is what the shadow pass must be.
- every micro-batch's token count divides by megatron's FP8 alignment (trainer/forward.py).
- the decode loop of `rollout.engine: megatron` is ours (KV cache, our attention mask); TE
  runs are rolled out by vLLM, as the H100 recipes do.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from megatron_calibclip.config import ConfigError
from megatron_calibclip.fp8 import FP8Recipe
from megatron_calibclip.fp8.backend import run_backend
from megatron_calibclip.fp8.te_install import TeInstall, install_problem
from megatron_calibclip.fp8.te import te_device_problem, te_environment_problem, te_token_multiple
from megatron_calibclip.models import ModelConfig, emulated_layer_spec, te_layer_spec

# The functions take the parts of the TrainConfig they read, not the TrainConfig: its checks
# call them (trainer/config.py), so this module sits below it.


def trainer_backend(fp8: FP8Recipe, machine: Optional[tuple] = None) -> str:
    """'te' when the trainer's FP8 section (`fp8`) resolves to Transformer Engine on this
    machine (then both models are built from TE's spec), else 'ours' (our linears, whose
    GEMMs run emulated or through torch._scaled_mm). machine: (CUDA, TE, _scaled_mm), for tests."""
    try:
        backend, _ = run_backend(fp8.backend, fp8, machine=machine)
    except ConfigError:  # a backend this machine lacks, in a run that reads no FP8 recipe
        return "ours"
    return "te" if backend == "te" else "ours"


def trainer_layer_spec(fp8: FP8Recipe, model_cfg: ModelConfig):
    """The layer spec both models of a run are built from."""
    if trainer_backend(fp8) == "te":
        return te_layer_spec(model_cfg)
    return emulated_layer_spec(model_cfg)


def check_te_run(*, params_dtype: str, rollout_engine: str,
                 recipes_in_use: Iterable[tuple[str, FP8Recipe]],
                 device: Optional[tuple] = None, install: Optional[TeInstall] = None) -> None:
    """ConfigError (one line) for a TE run that cannot start here. params_dtype: the resolved
    model.params_dtype; recipes_in_use: TrainConfig.fp8_recipes_in_use(). device: (compute
    capability, torch's CUDA version) of the GPU the run gets, and install: its TE install
    (fp8/te_install.py); None reads this machine's."""
    if params_dtype != "bf16":
        raise ConfigError("model.params_dtype: the Transformer Engine path runs BF16 "
                          "parameters (fp32 main parameters in the optimizer), so that its "
                          "'FP8 off' pass is the BF16 shadow pass; set it to bf16 or auto")
    if rollout_engine == "megatron":
        raise ConfigError("rollout.engine: 'megatron' decodes with our own attention and KV "
                          "cache, not TE's spec; with fp8.backend te set rollout.engine to "
                          "vllm (as the H100 recipes do), or fp8.backend to 'torch'")
    if install is not None or device is None:  # a TE built for another torch: one line
        problem = install_problem(install)
        if problem is not None:
            raise ConfigError(problem)
    if device is None:
        device = (torch.cuda.get_device_capability(), torch.version.cuda)
    for section, recipe in recipes_in_use:
        if section != "fp8":  # the rollout's FP8 runs in vLLM
            continue
        for problem in (te_device_problem(recipe, *device), te_environment_problem(recipe)):
            if problem is not None:
                raise ConfigError(problem)


def prepare_te_model(model: torch.nn.Module, fp8: FP8Recipe, tp: int) -> torch.nn.Module:
    """Mark a model built from TE's spec with the token multiple its FP8 GEMMs need."""
    model.calibclip_token_multiple = te_token_multiple(fp8, tp)
    return model
