"""Typed configuration of Calibrated Clipping (loadable from YAML with megatron_calibclip.config.from_dict).

Why every check here: a wrong clamp or a histogram range narrower than the clamps would make
calibration silently wrong, so bad values fail at load time with the field named.
eps_low / eps_high are not here: they belong to the host algorithm (GRPO / DAPO loss config)
and are passed to CalibratedClipper by the trainer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, get_args

from megatron_calibclip.config import ConfigError

MassMode = Literal["abs_adv_ratio", "tokens"]
ShadowPrecision = Literal["bf16", "fp32"]
UpperRule = Literal["log_scale", "quantile", "mass_fraction", "mass_balance", "host"]
SmoothingSpace = Literal["log", "linear"]
UPPER_RULES: tuple[str, ...] = get_args(UpperRule)
SMOOTHING_SPACES: tuple[str, ...] = get_args(SmoothingSpace)


@dataclass
class CalibrationConfig:
    """Calibrated Clipping: when to calibrate, how to smooth/clamp, how to estimate."""

    # K: calibrate on every step with step % period == 0 (step 0 included). Paper: 20; 10, 40 work.
    period: int = 20
    # EMA weight of the old bound: log L <- beta * log L + (1 - beta) * log L* (see
    # `smoothing`); the first successful calibration sets the bounds directly. 0: no smoothing.
    ema_beta: float = 0.5
    # Space of the EMA: "log" (default; bounds are ratios, so an average of log L treats
    # x0.5 and x2 symmetrically and one outlier H cannot drag the mean far) or "linear"
    # (the first implementation's arithmetic mean of L and H).
    smoothing: SmoothingSpace = "log"
    # How H is set once L* is known (docs/calibration.md has the study that chose the default):
    # "log_scale": log H = log(1 + eps_high) * log L / log(1 - eps_low) (widen both sides by
    #   the same factor in log space; reads no positive-token quantile: never infinite);
    # "quantile": count matching on A > 0, mirroring L: beta = share of A > 0 tokens with
    #   r_shadow > 1 + eps_high, H = (1 - beta)-quantile of r_fp8 over A > 0;
    # "mass_fraction": U+(r8, H) / U+(r8, inf) = U+(r16, 1 + eps_high) / U+(r16, inf);
    # "mass_balance": the SPEC's rule, smallest H with U+(r8, H) >= p_bf16 * U-(r8, L);
    # "host" ([ours], "L-only"): H stays the host's 1 + eps_high from the first step on (also
    #   before the first calibration: initial_upper is not read) and only L is calibrated; the
    #   control that separates a calibrated L from a wider H.
    upper_rule: UpperRule = "log_scale"
    # A quantile read from fewer BF16-clipped tokens is noise: fall back (keep the bounds,
    # log why) unless the shadow clips at least this many A < 0 tokens (for L) and, for the
    # rules that read the positive tail, unless at least this many A > 0 tokens lie above H
    # under FP8. 1 accepts any calibration (the first implementation).
    min_clipped_tokens: int = 20
    # [ours] Calibrate on the tokens of the last `pool_calibrations` calibration steps, this one
    # included: their merged histograms are summed, so L* is read from m times as many tokens.
    # 1 (default): this step's tokens only, as in the paper. Why more: at small batches the
    # shadow clips a handful of A < 0 tokens per step (the reproduction: 1-2 of ~190), so a
    # one-step L* is an extreme order statistic and min_clipped_tokens must be ~1 to calibrate
    # at all; pooling m steps reads it from m times as many clipped tokens at no extra compute.
    # The pooled steps' ratios are older (K to (m-1) K steps); pooled solves are one-pass (the
    # older steps' samples are not kept for refinement): error <= one bin (4.9e-4 in log r).
    pool_calibrations: int = 1
    # [ours] A calibration that fell back for lack of data (no A < 0 token, the shadow clips
    # none, or fewer than min_clipped_tokens) runs again on the next step instead of waiting K
    # steps. Why: at small batch a late, low-entropy GRPO step often holds no group with mixed
    # rewards, hence no A < 0 token at all (the reproduction: 6 of 10 calibration steps of
    # fp8-calibrated), and those steps train nothing either; retrying costs one more shadow
    # pass. false (default): the paper's fixed schedule, every K steps. Retries stay inside
    # the period of the calibration they repeat (at most `retry_steps` of them) and a pooled
    # calibration reads one step per period, its latest with data (docs/calibration.md).
    retry_on_scarce_data: bool = False
    # [ours] With retry_on_scarce_data: retry on at most this many steps after each scheduled
    # calibration, then wait for the next scheduled one. None (default): K - 1, every other
    # step of the period. A smaller number bounds the extra shadow passes while data stay
    # scarce (at most retry_steps per K steps).
    retry_steps: Optional[int] = None
    # Calibration only widens the host's bounds: L <= 1 - eps_low and H >= 1 + eps_high
    # (H is solved for the L actually used). false lets it tighten them too.
    widen_only: bool = True
    # Folder to record each calibration's inputs (per rank: log r_fp8, log r_shadow, A, mask
    # as a .pt file per calibration step) for offline study (benchmarks/calibration/); None: off.
    record_dir: Optional[str] = None
    # Lower bound L (a ratio, not an epsilon) used until the first calibration takes effect.
    initial_lower: float = 0.6
    # Upper bound H (a ratio) used until the first calibration takes effect (not read by
    # upper_rule "host", whose H is always 1 + eps_high).
    initial_upper: float = 1.8
    # Plausible range of a calibrated L: an L* outside [lower_min, lower_max] is a fallback
    # with a reason (never silently clamped to the edge).
    lower_min: float = 0.05
    # Upper end of the L range; must be < 1 so that L < 1 < H always holds.
    lower_max: float = 0.999
    # Plausible range of a calibrated H: an H* outside [upper_min, upper_max] (or infinite)
    # is a fallback with a reason, never the clamp value.
    upper_min: float = 1.001
    # Upper end of the H range.
    upper_max: float = 20.0
    # Effective update mass of a token: "abs_adv_ratio" = |A| * r (our default), "tokens" = 1.
    mass: MassMode = "abs_adv_ratio"
    # Precision of the shadow pass whose ratios define the target ("bf16" = the paper,
    # "fp32" = to check the BF16 target). Recorded in results; the math is the same.
    shadow_precision: ShadowPrecision = "bf16"
    # Histogram range in log r; must contain [log lower_min, log upper_max] so that answers
    # that fall in the under/overflow slots are clamped to the same bound as the exact ones.
    log_ratio_min: float = -4.0
    # Upper end of the histogram range in log r.
    log_ratio_max: float = 4.0
    # Number of bins over the range; one-pass error <= (max - min) / bins in log r (4.9e-4).
    bins: int = 16384
    # Second pass that re-bins only the bracketing bins (one more all-reduce, rarely two):
    # error <= (max - min) / (bins * refine_bins) in log r (1.2e-7 with the defaults). On by
    # default: the issue requires <= 1e-4, which one pass over 2^14 bins cannot guarantee;
    # costs ~200 KB more per rank and keeps the binned samples until compute (README.md).
    # false = one pass (error up to one bin; pass 1 only), e.g. with a finer `bins`.
    refine: bool = True
    # Sub-bins of the bracketing bin in the refinement pass.
    refine_bins: int = 4096
    # Relative tolerance (of the channel total) with which a cumulative mass "reaches" a
    # target, so sums that are equal but added in another order give the same answer.
    mass_rtol: float = 1e-9

    def __post_init__(self) -> None:
        _check(self.period >= 1, "period", self.period, "an integer >= 1")
        _check(0.0 <= self.ema_beta < 1.0, "ema_beta", self.ema_beta, "a number in [0, 1)")
        _check(0.0 < self.lower_min < self.lower_max < 1.0, "lower_min/lower_max",
               (self.lower_min, self.lower_max), "0 < lower_min < lower_max < 1")
        _check(1.0 < self.upper_min < self.upper_max and math.isfinite(self.upper_max),
               "upper_min/upper_max", (self.upper_min, self.upper_max), "1 < upper_min < upper_max < inf")
        _check(self.lower_min <= self.initial_lower <= self.lower_max, "initial_lower",
               self.initial_lower, f"a ratio in [{self.lower_min}, {self.lower_max}]")
        _check(self.upper_min <= self.initial_upper <= self.upper_max, "initial_upper",
               self.initial_upper, f"a ratio in [{self.upper_min}, {self.upper_max}]")
        _check(self.mass in ("abs_adv_ratio", "tokens"), "mass", self.mass, "one of ['abs_adv_ratio', 'tokens']")
        _check(self.shadow_precision in ("bf16", "fp32"), "shadow_precision", self.shadow_precision,
               "one of ['bf16', 'fp32']")
        _check(math.isfinite(self.log_ratio_min) and self.log_ratio_min <= math.log(self.lower_min),
               "log_ratio_min", self.log_ratio_min, f"finite and <= log(lower_min) = {math.log(self.lower_min):.4f}")
        _check(math.isfinite(self.log_ratio_max) and self.log_ratio_max >= math.log(self.upper_max),
               "log_ratio_max", self.log_ratio_max, f"finite and >= log(upper_max) = {math.log(self.upper_max):.4f}")
        _check(self.bins >= 1, "bins", self.bins, "an integer >= 1")
        _check(self.refine_bins >= 2, "refine_bins", self.refine_bins, "an integer >= 2")
        _check(self.smoothing in SMOOTHING_SPACES, "smoothing", self.smoothing, f"one of {list(SMOOTHING_SPACES)}")
        _check(self.upper_rule in UPPER_RULES, "upper_rule", self.upper_rule, f"one of {list(UPPER_RULES)}")
        _check(isinstance(self.min_clipped_tokens, int) and not isinstance(self.min_clipped_tokens, bool)
               and self.min_clipped_tokens >= 1, "min_clipped_tokens", self.min_clipped_tokens, "an integer >= 1")
        _check(isinstance(self.pool_calibrations, int) and not isinstance(self.pool_calibrations, bool)
               and self.pool_calibrations >= 1, "pool_calibrations", self.pool_calibrations, "an integer >= 1")
        _check(isinstance(self.retry_on_scarce_data, bool), "retry_on_scarce_data", self.retry_on_scarce_data,
               "true or false")
        _check(self.retry_steps is None or (isinstance(self.retry_steps, int) and not isinstance(self.retry_steps, bool)
                                            and 1 <= self.retry_steps <= self.period - 1),
               "retry_steps", self.retry_steps, f"null (= period - 1) or an integer in [1, period - 1 = {self.period - 1}]")
        _check(isinstance(self.widen_only, bool), "widen_only", self.widen_only, "true or false")
        _check(self.record_dir is None or (isinstance(self.record_dir, str) and self.record_dir != ""),
               "record_dir", self.record_dir, "a folder path or null")
        _check(0.0 <= self.mass_rtol < 1e-3, "mass_rtol", self.mass_rtol, "a number in [0, 1e-3)")

    @property
    def resolution(self) -> float:
        """Guaranteed error bound (log r) of a calibrated bound before clamping (a pooled
        calibration, pool_calibrations > 1, is one-pass: one bin)."""
        width = (self.log_ratio_max - self.log_ratio_min) / self.bins
        return width / self.refine_bins if self.refine else width

    @property
    def max_retries(self) -> int:
        """Steps after a scheduled calibration on which retry_on_scarce_data may retry it (0: off)."""
        if not self.retry_on_scarce_data:
            return 0
        return self.period - 1 if self.retry_steps is None else self.retry_steps


def _check(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"calibration.{field}: {value!r} is invalid; allowed: {allowed}")
