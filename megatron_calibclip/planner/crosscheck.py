"""The planner's numbers next to published ones (docs/planner.md quotes this table).

Why in code: the comparison is recomputed by `calibclip plan --crosscheck` and by the tests,
so a change to the byte model that breaks agreement with a published figure fails loudly.
Each entry names its source exactly; `error_pct` is (ours - published) / published.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_calibclip.planner import activations as act
from megatron_calibclip.planner.params import stage_params
from megatron_calibclip.planner.spec import Layout
from megatron_calibclip.planner.states import bytes_per_param

MIB = 1024**2


@dataclass(frozen=True)
class CrossCheck:
    name: str
    source: str
    published: float
    ours: float
    unit: str
    note: str = ""

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.ours - self.published) / self.published


ZERO = ("Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion Parameter "
        "Models, SC'20, arXiv:1910.02054, Figure 1 (psi = 7.5B, K = 12, N_d = 64)")
MEGATRON_8B = ("NVIDIA/dgxc-benchmarking, llama3.1/README.md, Megatron log of Llama-3 8B on 8 "
               "GPUs, TP1 PP1 CP1 (DP 8, distributed optimizer): 'Theoretical memory footprints: "
               "weight and optimizer=57438.81 MB', 'mem-allocated-gigabytes: 51.072'")
KORTHIKANTI = ("Korthikanti et al., Reducing Activation Recomputation in Large Transformer "
               "Models, MLSys 2023, arXiv:2205.05198, Table 2 (bytes per layer)")
# Table 3 of the same paper: hidden, heads, TP (sequence length 2048, micro-batch 1)
PAPER_MODELS = {"22B": (6144, 64, 8), "175B": (12288, 96, 8), "530B": (20480, 128, 8),
                "1T": (25600, 160, 8)}


def zero_checks() -> list[CrossCheck]:
    """Model states of a 7.5B model, 16-bit weights and gradients (ZeRO's 2 + 2 + K)."""
    psi = 7.5e9
    plain = Layout(dp=64, distributed_optimizer=False, grad_dtype="bf16")
    sharded = Layout(dp=64, distributed_optimizer=True, grad_dtype="bf16")
    return [
        CrossCheck("ZeRO 7.5B baseline DP, model states per GPU", ZERO, 120.0,
                   bytes_per_param(plain) * psi / 1e9, "GB"),
        CrossCheck("ZeRO 7.5B P_os (optimizer states sharded over 64), per GPU", ZERO, 31.4,
                   bytes_per_param(sharded) * psi / 1e9, "GB",
                   "= Megatron's distributed optimizer with 16-bit gradients"),
    ]


def megatron_8b_checks() -> list[CrossCheck]:
    from megatron_calibclip.models.config import get_preset

    m = get_preset("llama3-8b")
    n = stage_params(m, 1, 1, 0).total
    layout = Layout(tp=1, pp=1, dp=8, distributed_optimizer=True, grad_dtype="fp32",
                    precision="bf16")
    states = bytes_per_param(layout) * n
    return [
        CrossCheck("Llama-3 8B parameters on the most loaded GPU", MEGATRON_8B, 8.0305,
                   n / 1e9, "B params"),
        CrossCheck("Llama-3 8B weights + grads + optimizer, DP 8 (Megatron's estimator)",
                   MEGATRON_8B, 57438.81, states / MIB, "MiB"),
        CrossCheck("Llama-3 8B memory allocated between iterations (measured)", MEGATRON_8B,
                   51.072, states / 1e9, "GB",
                   "measured; the log does not state the gradient dtype or the GB unit "
                   "(GiB would make it +9.8%): read as an upper bound, not agreement"),
    ]


def korthikanti_checks() -> list[CrossCheck]:
    """Our term list in the paper's GPT configuration against the closed forms of Table 2."""
    out = []
    s, b = 2048, 1
    for name, (h, a, t) in PAPER_MODELS.items():
        layer = act.paper_gpt(h, a)
        sbh = s * b * h
        cases = {
            "no parallelism": (layer.bytes(s, b, 1, False), sbh * (34 + 5 * a * s / h)),
            "TP": (layer.bytes(s, b, t, False), sbh * (10 + 24 / t + 5 * a * s / (h * t))),
            "TP + SP": (layer.bytes(s, b, t, True), sbh * (34 / t + 5 * a * s / (h * t))),
            "TP + SP + selective": (layer.bytes(s, b, t, True, "selective"), sbh * 34 / t),
            "full recompute": (layer.bytes(s, b, 1, False, "full"), 2 * sbh),
        }
        for case, (ours, published) in cases.items():
            out.append(CrossCheck(f"GPT-{name} layer activations, {case} (t={t})", KORTHIKANTI,
                                  published / MIB, ours / MIB, "MiB",
                                  "formula identity: checks the term bookkeeping"))
    return out


def all_checks() -> list[CrossCheck]:
    return zero_checks() + megatron_8b_checks() + korthikanti_checks()


def table(checks: list[CrossCheck]) -> str:
    lines = [f"{'check':<74} {'published':>12} {'planner':>12} {'unit':<8} {'error':>7}",
             "-" * 118]
    for c in checks:
        lines.append(f"{c.name:<74} {c.published:>12.4f} {c.ours:>12.4f} {c.unit:<8} "
                     f"{c.error_pct:>+6.2f}%")
    lines.append("")
    for src in dict.fromkeys(c.source for c in checks):
        lines.append(f"source: {src}")
    return "\n".join(lines)
