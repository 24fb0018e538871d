"""What one GPU check run measures, and how big: the full sizes for one H100/H200 (8 minutes
in all), or tiny ones for `--smoke` on a CPU.

Why one frozen object: every section reads its shapes from here, so the smoke runs exactly
the code paths of the GPU run, only smaller, and the JSON records which sizes produced it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Run order: the trainer section last, as the longest and the one a device-placement bug
# stops today, so the figures of the others are in the JSON first.
SECTION_NAMES: tuple[str, ...] = ("a_quantizer", "b_native_vs_emulated", "c_batch_invariance",
                                  "f_te_vs_emulation", "e_throughput", "d_grpo")


@dataclass(frozen=True)
class ModelShape:
    """A GPT shape as `models.get_preset("tiny", **overrides)` takes it."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int = 4096

    def overrides(self) -> dict:
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "ffn_hidden_size": self.ffn_hidden_size,
                "num_attention_heads": self.num_attention_heads,
                "num_query_groups": self.num_query_groups, "vocab_size": self.vocab_size,
                "max_position_embeddings": 2048, "make_vocab_size_divisible_by": 128}


@dataclass(frozen=True)
class CheckOptions:
    device: str  # "cuda" or "cpu"
    smoke: bool  # tiny shapes and few steps (CPU CI)
    sections: tuple[str, ...] = SECTION_NAMES
    # (a) GEMM operands: x [gemm_m, K] against W [gemm_n, K] for each K
    gemm_m: int = 2048
    gemm_n: int = 4096
    k_values: tuple[int, ...] = (4096, 12288)
    # (b), (c), (f): a small GPT and the token batch its log-probs are taken on; the sequence
    # length divides by 32, so every micro-batch of TE's FP8 GEMMs has a token count TE takes
    # (fp8/te.py te_token_multiple: 16, 32 for mxfp8) without padding
    small_model: ModelShape = field(default_factory=lambda: ModelShape(4, 512, 1536, 8, 4))
    logprob_batch: int = 8
    logprob_seq: int = 256
    # (f): one linear layer, TE's vs ours: tokens x in -> out (forward, dgrad, wgrad)
    linear_shape: tuple[int, int, int] = (512, 256, 512)
    # (d): GRPO steps of a ~100M-parameter random model through the trainer
    grpo_model: ModelShape = field(default_factory=lambda: ModelShape(16, 768, 2048, 12, 4))
    grpo_steps: int = 20
    grpo_calibration_period: int = 5
    grpo_prompts_per_step: int = 16
    grpo_group_size: int = 8
    grpo_new_tokens: int = 16
    # (e): training steps of a 1-3B shape, BF16 and FP8 interleaved
    big_model: ModelShape = field(default_factory=lambda: ModelShape(24, 2048, 5632, 16, 16, 32000))
    throughput_batch: int = 2
    throughput_seq: int = 1024
    throughput_warmup_steps: int = 2
    throughput_steps: int = 4

    @classmethod
    def for_run(cls, device: str, smoke: bool, sections: tuple[str, ...] = SECTION_NAMES
                ) -> "CheckOptions":
        if not smoke:
            return cls(device=device, smoke=False, sections=sections)
        tiny = ModelShape(2, 128, 256, 4, 2, 512)
        return cls(device=device, smoke=True, sections=sections, gemm_m=32, gemm_n=128,
                   small_model=tiny, logprob_batch=8, logprob_seq=32,
                   grpo_model=ModelShape(2, 64, 128, 4, 2), grpo_steps=2,
                   grpo_calibration_period=1, grpo_prompts_per_step=4, grpo_group_size=4,
                   grpo_new_tokens=3, big_model=ModelShape(2, 128, 256, 4, 4, 512),
                   throughput_batch=2, throughput_seq=32, throughput_warmup_steps=1,
                   throughput_steps=2)
