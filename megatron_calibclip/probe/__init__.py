"""Measurement probes built on the package (floor 4, beside trainer/: they compose models, fp8,
data and parallel, and are driven by cli.py).

`fp8-noise` (fp8_noise.py): how far emulated FP8 log-probs are from BF16 and fp32, and how
much importance-ratio noise (and phantom clipping) each noise source of the SPEC produces,
per FP8 recipe. See docs/fp8-noise.md.
"""
from megatron_calibclip.probe.fp8_noise import (
    PROB_EDGES,
    ProbeConfig,
    ProbeError,
    bucket_stats,
    parse_recipes,
    ratio_stats,
    run_fp8_noise,
)

__all__ = [
    "PROB_EDGES",
    "ProbeConfig",
    "ProbeError",
    "bucket_stats",
    "parse_recipes",
    "ratio_stats",
    "run_fp8_noise",
]
