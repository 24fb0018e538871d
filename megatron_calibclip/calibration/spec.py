"""SolveSpec: everything the solver needs to know besides the merged histogram.

Why a frozen record of its own: the accumulator (filling, per mini-batch) and the solver
(once, on merged values) both read these settings; giving the solver this record instead of
the accumulator keeps the dependency one-way (bounds.py -> solver.py -> spec.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_calibclip.calibration.config import UPPER_RULES

MASS_MODES = ("abs_adv_ratio", "tokens")
SHADOW_PRECISIONS = ("bf16", "fp32")
# upper rules whose H is read from the positive tokens' FP8 ratios (a tail quantile or a
# mass threshold): they need enough positive tokens above H to be more than noise
TAIL_RULES = ("quantile", "mass_fraction", "mass_balance")


@dataclass(frozen=True)
class SolveSpec:
    """Host epsilons, mass definition, H rule, guards and refinement of one calibration."""

    eps_low: float
    eps_high: float
    mass: str = "abs_adv_ratio"  # effective update mass: |A| r, or 1 per token ("tokens")
    shadow_precision: str = "bf16"  # recorded in results only
    upper_rule: str = "log_scale"  # see CalibrationConfig.upper_rule
    min_clipped_tokens: int = 20  # fewer BF16-clipped (or FP8 tail) tokens: fall back
    widen_only: bool = True  # L <= 1 - eps_low, H >= 1 + eps_high
    dual_clip_c: float | None = None  # the loss's dual-clip c: A<0 tokens with r > c have no gradient
    lower_min: float = 0.05  # L* outside [lower_min, lower_max]: fall back
    lower_max: float = 0.999
    upper_min: float = 1.001  # H* outside [upper_min, upper_max] or infinite: fall back
    upper_max: float = 20.0
    refine: bool = True
    refine_bins: int = 4096

    def __post_init__(self) -> None:
        if not 0.0 < self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in (0, 1), got {self.eps_low}")
        if not (self.eps_high > 0.0 and math.isfinite(self.eps_high)):
            raise ValueError(f"eps_high must be a positive number, got {self.eps_high}")
        if self.mass not in MASS_MODES:
            raise ValueError(f"mass {self.mass!r} is not one of {list(MASS_MODES)}")
        if self.shadow_precision not in SHADOW_PRECISIONS:
            raise ValueError(f"shadow_precision {self.shadow_precision!r} is not one of {list(SHADOW_PRECISIONS)}")
        if self.upper_rule not in UPPER_RULES:
            raise ValueError(f"upper_rule {self.upper_rule!r} is not one of {list(UPPER_RULES)}")
        if int(self.min_clipped_tokens) != self.min_clipped_tokens or self.min_clipped_tokens < 1:
            raise ValueError(f"min_clipped_tokens must be an integer >= 1, got {self.min_clipped_tokens}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 or None, got {self.dual_clip_c}")
        # CalibrationConfig keeps L < 1 < H; the solver itself also takes 0 / inf (no range)
        if not 0.0 <= self.lower_min < self.lower_max:
            raise ValueError(f"need 0 <= lower_min < lower_max, got {self.lower_min}, {self.lower_max}")
        if not 0.0 <= self.upper_min < self.upper_max:
            raise ValueError(f"need 0 <= upper_min < upper_max, got {self.upper_min}, {self.upper_max}")
        if self.refine_bins < 2:
            raise ValueError(f"refine_bins must be >= 2, got {self.refine_bins}")

    @property
    def log_lower_range(self) -> tuple[float, float]:
        return _log(self.lower_min), _log(self.lower_max)

    @property
    def log_upper_range(self) -> tuple[float, float]:
        return _log(self.upper_min), _log(self.upper_max)

    @property
    def t_low(self) -> float:
        """log(1 - eps_low): an A<0 token is clipped iff log r <= t_low (float64)."""
        return math.log1p(-self.eps_low)

    @property
    def t_high(self) -> float:
        """log(1 + eps_high): an A>0 token is clipped iff log r > t_high."""
        return math.log1p(self.eps_high)

    @property
    def t_dual(self) -> float:
        """log c of dual-clip (A<0 tokens above it get no gradient), +inf without dual-clip."""
        return math.inf if self.dual_clip_c is None else math.log(self.dual_clip_c)

    @property
    def neg_mass_channel(self) -> str:
        return "neg_mass" if self.mass == "abs_adv_ratio" else "neg_count"

    @property
    def pos_mass_channel(self) -> str:
        return "pos_mass" if self.mass == "abs_adv_ratio" else "pos_count"

    @property
    def reads_positive_tail(self) -> bool:
        return self.upper_rule in TAIL_RULES


def _log(x: float) -> float:
    return -math.inf if x == 0.0 else math.log(x)
