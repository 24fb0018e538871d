"""The probe's settings (ProbeConfig), its recipes and constants, and its one error type.

Kept apart from the measurement (fp8_noise.py) so that the CLI can validate a command line
without importing torch-heavy code paths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

PROB_EDGES: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5, 1.0)
GRANULARITIES: tuple[str, ...] = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
TOKEN_SOURCES: tuple[str, ...] = ("chain_sum", "samples", "random")
# probe.emulation -> (FP8Recipe.weight_source, FP8Recipe.activation_precision)
EMULATIONS = {"bf16_stack": ("bf16", "bf16"), "bf16_weights": ("bf16", "fp32"),
              "gemm_only": ("fp32", "fp32")}
PAD_ID, BOS_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2, 3  # byte tokenisation
SMALL_MODEL_PARAMS = 10_000_000  # random-weight models up to this size get a warm-up by default
DEFAULT_WARMUP_STEPS = 60


class ProbeError(ValueError):
    """A probe setting is invalid, or what it needs is missing; the message says which."""


@dataclass(frozen=True)
class ProbeConfig:
    # Model preset (megatron_calibclip.models.PRESETS) built with random weights (seed), or,
    # with `load`, the architecture read from the HF folder's config.json.
    model: str = "tiny"
    # Hugging Face folder (config.json + *.safetensors) loaded through megatron_calibclip.
    # checkpoint (HFSource / load_hf_into_model); None = random weights.
    load: Optional[str] = None
    # FP8 granularities compared side by side (forward GEMMs in E4M3; the probe runs no FP8
    # backward, so the hybrid format would give the same numbers).
    recipes: tuple[str, ...] = GRANULARITIES
    # "chain_sum": reasoning-gym chain_sum question + answer text (every position measured);
    # "samples": chain_sum questions + responses sampled from the model (fp32, KV-cached
    # rollout engine), only response tokens measured (as in RL); "random": uniform token ids.
    tokens: str = "chain_sum"
    # Number of sequences in the probed batch.
    num_seqs: int = 32
    # Longest sequence in tokens (text is truncated); random tokens: lengths in [max/2, max].
    max_len: int = 128
    # samples only: response length limit (tokens, EOS included) and sampling temperature.
    sample_len: int = 48
    temperature: float = 1.0
    # chain_sum only: fraction of the probed positions (after the first) replaced by uniform
    # random token ids, a stand-in for the unlikely tokens sampling produces (they populate
    # the p < 0.01 bucket; a model that read only clean text gives them p ~ 1e-4).
    corrupt: float = 0.05
    # Layout A (old log-probs): consecutive micro-batches of this many sequences.
    old_micro_batch: int = 8
    # Layout B (current log-probs): micro-batches of this many sequences after a shuffle.
    micro_batch: int = 4
    # Learning rates of the one-step "update" sources (w <- w - lr * sign(grad)).
    lrs: tuple[float, ...] = (1e-6, 1e-5)
    # PPO lower clip: a negative-advantage token is clipped when r < 1 - eps_low.
    eps_low: float = 0.2
    # PPO upper clip: a positive-advantage token is clipped when r > 1 + eps_high.
    eps_high: float = 0.28
    # Fraction of sequences given advantage -1 (the others +1).
    neg_frac: float = 0.5
    # Supervised warm-up steps before probing (fp32, Adam). None = DEFAULT_WARMUP_STEPS for a
    # random-weight model of <= SMALL_MODEL_PARAMS parameters, else 0.
    warmup_steps: Optional[int] = None
    # Adam learning rate of the warm-up.
    warmup_lr: float = 3e-3
    # Sequences per warm-up step (drawn from 4x as many problems as the probe batch, seeded).
    warmup_batch: int = 16
    # With `load`: shift fp32 weights lying exactly halfway between two bf16 values by a
    # seeded random amount below half a bf16 step (checkpoint.ties); None = leave them.
    break_bf16_ties: Optional[int] = None
    # Move weights that sit exactly on a bf16 or E4M3 (power-of-two scale) rounding tie by a
    # seeded amount below half a bf16 step, keeping their bf16 values (dither_weights()); None =
    # leave them. Checkpoints stored in bf16 or 4-bit GGUF are full of such ties.
    dither_weights: Optional[int] = None
    # Seed of the weights, data, layouts, advantages and warm-up.
    seed: int = 0
    # What the bf16 and fp8 rows emulate: "bf16_stack" (default: bf16 model copy quantized,
    # activations bf16 between modules, as megatron + TE on GPU), "bf16_weights" (bf16 copy
    # quantized, fp32 activations) or "gemm_only" (fp32 masters quantized, only GEMM operands
    # rounded: the emulation before the bf16 stack). Side by side, they attribute the noise.
    emulation: str = "bf16_stack"

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipes", parse_recipes(self.recipes))
        object.__setattr__(self, "lrs", tuple(float(v) for v in self.lrs))
        if self.load is None:
            from megatron_calibclip.models.config import PRESETS

            if self.model not in PRESETS:
                raise ProbeError(f"probe.model: {self.model!r} is not one of {sorted(PRESETS)} "
                                 f"(or give --load HF_DIR)")
        if self.tokens not in TOKEN_SOURCES:
            raise ProbeError(f"probe.tokens: {self.tokens!r} is not one of {list(TOKEN_SOURCES)}")
        if self.emulation not in EMULATIONS:
            raise ProbeError(f"probe.emulation: {self.emulation!r} is not one of "
                             f"{list(EMULATIONS)}")
        if not self.temperature > 0:
            raise ProbeError(f"probe.temperature: must be > 0, got {self.temperature}")
        for name in ("num_seqs", "old_micro_batch", "micro_batch", "warmup_batch", "sample_len"):
            if getattr(self, name) < 1:
                raise ProbeError(f"probe.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_len < 4:
            raise ProbeError(f"probe.max_len: must be >= 4, got {self.max_len}")
        if not self.lrs or any(not (lr > 0 and math.isfinite(lr)) for lr in self.lrs):
            raise ProbeError(f"probe.lrs: need one or more positive learning rates, got "
                             f"{list(self.lrs)}")
        if not 0 < self.eps_low < 1:
            raise ProbeError(f"probe.eps_low: must be in (0, 1), got {self.eps_low}")
        if not self.eps_high > 0:
            raise ProbeError(f"probe.eps_high: must be > 0, got {self.eps_high}")
        if not 0 <= self.corrupt < 1:
            raise ProbeError(f"probe.corrupt: must be in [0, 1), got {self.corrupt}")
        if not 0 < self.neg_frac <= 1:
            raise ProbeError(f"probe.neg_frac: must be in (0, 1], got {self.neg_frac}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ProbeError(f"probe.warmup_steps: must be >= 0, got {self.warmup_steps}")


def parse_recipes(spec: str | Sequence[str]) -> tuple[str, ...]:
    """"all" | "tensorwise,blockwise" | a list of names -> validated granularities, in the
    canonical order, without duplicates."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for item in items:
        for name in str(item).split(","):
            name = name.strip()
            if not name:
                continue
            if name == "all":
                names.extend(GRANULARITIES)
            elif name in GRANULARITIES:
                names.append(name)
            else:
                raise ProbeError(f"probe.recipes: {name!r} is not one of "
                                 f"{list(GRANULARITIES) + ['all']}")
    if not names:
        raise ProbeError("probe.recipes: no recipe given")
    return tuple(g for g in GRANULARITIES if g in names)
