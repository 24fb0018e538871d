"""CalibrationResult: what one calibration found, or why it fell back.

Kept apart from the estimator so that the clipper, the trainer's logger and checkpoints can
use results without importing any distributed code paths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class CalibrationResult:
    """Raw calibrated bounds of one calibration (before clamps and smoothing).

    `lower` / `upper` are ratios (e.g. 0.74 / 1.31), not epsilons; `log_lower` / `log_upper`
    are the exact grid values they come from (use these for exact comparisons). On a fallback
    `reason` says why and the bounds are None; `alpha` / `p_bf16` are filled when defined.
    """

    lower: float | None  # L to use: L* (alpha-quantile of the FP8 ratios of N, rounded up to
    #   the grid), capped at 1 - eps_low when widen-only
    upper: float | None  # H to use: H* by `upper_rule` for that L, raised to 1 + eps_high when widen-only
    log_lower: float | None  # log of `lower` (a grid point, or log(1 - eps_low))
    log_upper: float | None  # log of `upper` (a grid point, closed form for log_scale, or log(1 + eps_high))
    alpha: float | None  # fraction of N the shadow clips: #{r_shadow <= 1 - eps_low} / |N|
    p_bf16: float | None  # U+(r_shadow, 1 + eps_high) / U-(r_shadow, 1 - eps_low)
    n_valid: int  # tokens with mask True (all ranks)
    n_neg: int  # |N|: valid, finite, A < 0
    n_pos: int  # |P|: valid, finite, A > 0
    n_neg_clipped_shadow: int  # k = alpha * |N|: N tokens with r_shadow <= 1 - eps_low
    n_nonfinite: int  # valid tokens with a non-finite log-ratio or advantage (any -> fallback)
    reason: str | None  # None, or "<code>: <explanation>" of the fallback
    mass: str  # "abs_adv_ratio" or "tokens"
    shadow_precision: str  # "bf16" or "fp32"
    refined: bool  # whether the refinement pass was requested
    resolution: float  # guaranteed error bound in log r of log_lower / log_upper
    num_collectives: int  # all-reduces issued (1 without refinement)
    bytes_communicated: int  # all-reduce payload bytes per rank (O(bins), not O(tokens))
    neg_clip_frac_fp8_eps: float | None  # P(r8 <= 1 - eps_low | N): vanilla FP8 lower clipping
    phantom_clip_frac_eps: float | None  # P(r8 <= 1 - eps_low and r_shadow > 1 - eps_low | N)
    pos_clip_frac_shadow_eps: float | None  # P(r_shadow > 1 + eps_high | P)
    pos_clip_frac_fp8_eps: float | None  # P(r8 > 1 + eps_high | P)
    neg_clip_frac_fp8_lower: float | None  # P(r8 <= L* | N) (>= alpha, = alpha up to one bin)
    pos_clip_frac_fp8_upper: float | None  # P(r8 > H | P) (log_scale: within one bin)
    upper_rule: str = "mass_balance"  # how H was set (CalibrationConfig.upper_rule)
    beta: float | None = None  # fraction of P the shadow clips: #{r_shadow > 1 + eps_high} / |P|
    n_pos_clipped_shadow: int = 0  # beta * |P|
    log_lower_raw: float | None = None  # log L* before the widen-only cap (also on later fallbacks)
    log_upper_raw: float | None = None  # log H* before the widen-only floor (also on later fallbacks)
    pooled_calibrations: int = 1  # calibration steps whose tokens this result read (pool_calibrations)

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def reason_code(self) -> str | None:
        """The stable code of `reason` (the part before ':'), e.g. 'alpha_zero'."""
        return None if self.reason is None else self.reason.split(":", 1)[0]

    def metrics(self, prefix: str = "calib/") -> dict[str, float]:
        """Numeric fields for a logger; None becomes NaN, bools 0/1."""
        out: dict[str, float] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str) or (value is None and f.name == "reason"):
                continue
            out[prefix + f.name] = float("nan") if value is None else float(value)
        for name in ("lower", "upper"):  # L*, H* as ratios (what the rule found, before widen-only)
            raw = getattr(self, f"log_{name}_raw")
            out[f"{prefix}{name}_raw"] = float("nan") if raw is None else math.exp(raw)
        out[prefix + "fallback"] = 0.0 if self.ok else 1.0
        return out

    def labels(self, prefix: str = "calib/") -> dict[str, str]:
        """The string fields for a JSONL logger: the rule and the fallback reason ("" if none)."""
        return {prefix + "upper_rule": self.upper_rule, prefix + "fallback_reason": self.reason or ""}
