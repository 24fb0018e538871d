"""Activation memory of one transformer layer, term by term, and of a pipeline stage.

Why term by term: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", arXiv:2205.05198, Table 2) derive 34sbh + 5as^2b bytes per layer for a
GPT layer (MHA, 4h GELU MLP, dropout, attention scores materialised). Our models differ in
every one of those points: GQA, SwiGLU with its own FFN width, no dropout, flash attention
(no s^2 term), QK-norm (Qwen3), and FP8 GEMMs that save their inputs in FP8. Listing each
saved tensor with its byte count and with how it is split (by TP always, or by TP only
under sequence parallelism) gives both: `paper_gpt` rebuilds the paper's numbers exactly
(tests check it), `for_model` is ours.

Units: a term's `per_token` is bytes per token of a micro-batch (s*b tokens); terms that
grow with the sequence (the materialised attention scores) also scale with s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_calibclip.models.config import ModelConfig

Split = Literal["tp", "sp"]  # "tp": divided by TP; "sp": divided by TP only with SP


@dataclass(frozen=True)
class Term:
    name: str
    per_token: float  # bytes per token (times s for `per_seq` terms)
    split: Split
    core_attention: bool = False  # dropped by selective (core-attention) recomputation
    per_seq: bool = False  # also proportional to the sequence length (attention scores)

    def bytes(self, s: int, b: int, tp: int, sp: bool) -> float:
        value = self.per_token * s * b * (s if self.per_seq else 1)
        return value / tp if (self.split == "tp" or sp) else value


@dataclass(frozen=True)
class LayerActivations:
    terms: tuple[Term, ...]
    input_bytes: float  # bytes per token of the layer input (what full recompute keeps)

    def bytes(self, s: int, b: int, tp: int, sp: bool, recompute: str = "none") -> float:
        """Bytes one layer keeps for backward for one micro-batch."""
        if recompute == "full":
            return self.input_bytes * s * b / (tp if sp else 1)
        keep = [t for t in self.terms if not (recompute == "selective" and t.core_attention)]
        return sum(t.bytes(s, b, tp, sp) for t in keep)

    def breakdown(self, s: int, b: int, tp: int, sp: bool) -> dict[str, float]:
        return {t.name: t.bytes(s, b, tp, sp) for t in self.terms}


def paper_gpt(hidden: int, heads: int) -> LayerActivations:
    """The GPT layer of Korthikanti et al. 2022, section 4.1 (16-bit activations)."""
    h, a = hidden, heads
    return LayerActivations((
        Term("attention layernorm input", 2 * h, "sp"),
        Term("QKV input", 2 * h, "sp"),
        Term("Q, K (for QK^T)", 4 * h, "tp"),
        Term("softmax output", 2 * a, "tp", core_attention=True, per_seq=True),
        Term("softmax dropout mask", 1 * a, "tp", core_attention=True, per_seq=True),
        Term("attention over V: dropout output", 2 * a, "tp", core_attention=True, per_seq=True),
        Term("attention over V: V", 2 * h, "tp"),
        Term("output projection input", 2 * h, "tp"),
        Term("attention dropout mask", 1 * h, "sp"),
        Term("MLP layernorm input", 2 * h, "sp"),
        Term("FC1 input", 2 * h, "sp"),
        Term("GeLU input", 8 * h, "tp"),
        Term("FC2 input", 8 * h, "tp"),
        Term("MLP dropout mask", 1 * h, "sp"),
    ), input_bytes=2 * h)


def for_model(m: ModelConfig, precision: str = "fp8") -> LayerActivations:
    """One Llama/Qwen layer: GQA, SwiGLU, RMSNorm, RoPE, no dropout, flash attention.

    With FP8 GEMMs Transformer Engine saves each GEMM input in FP8 (1 byte) for the
    weight-gradient GEMM; flash attention then keeps its BF16 output apart from the FP8
    copy the output projection saves. Flash attention stores no s x s scores, only a
    per-row log-sum-exp (FP32).
    """
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.head_dim
    qd, kvd = m.num_attention_heads * d, m.num_query_groups * d
    c = 1 if precision == "fp8" else 2  # bytes of a saved GEMM input
    terms = [
        Term("attention RMSNorm input", 2 * h, "sp"),
        Term("QKV GEMM input", c * h, "sp"),
        Term("Q, K, V after RoPE (flash attention inputs)", 2 * (qd + 2 * kvd), "tp"),
    ]
    if m.qk_norm:
        terms.append(Term("QK-norm inputs", 2 * (qd + kvd), "tp"))
    terms += [
        Term("flash attention log-sum-exp (FP32)", 4 * m.num_attention_heads, "tp",
             core_attention=True),
        Term("output projection input", c * qd, "tp"),
    ]
    if c == 1:
        terms.append(Term("flash attention output (BF16)", 2 * qd, "tp", core_attention=True))
    terms += [
        Term("MLP RMSNorm input", 2 * h, "sp"),
        Term("FC1 GEMM input", c * h, "sp"),
        Term("FC1 output (gate and up, SwiGLU input)", 2 * 2 * f, "tp"),
        Term("FC2 GEMM input (SwiGLU output)", c * f, "tp"),
    ]
    return LayerActivations(tuple(terms), input_bytes=2 * h)


# Output layer and log-probs on the last stage, per token and vocabulary entry / TP:
# BF16 logits (2) + their FP32 copy for the vocab-parallel log-softmax (4) + the FP32
# softmax it keeps for backward (4).
LOGIT_BYTES = 2 + 4 + 4


def output_bytes(m: ModelConfig, s: int, b: int, tp: int, sp: bool) -> float:
    """Final norm input + output GEMM input (BF16) + logits and log-prob buffers."""
    hidden = (2 + 2) * m.hidden_size * s * b / (tp if sp else 1)
    return hidden + LOGIT_BYTES * s * b * m.padded_vocab_size(tp) / tp


def in_flight_microbatches(pp: int, stage: int, microbatches: int) -> int:
    """1F1B: stage i holds activations of min(pp - i, m) micro-batches at its peak."""
    return max(1, min(pp - stage, microbatches))
