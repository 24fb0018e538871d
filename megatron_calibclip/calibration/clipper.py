"""CalibratedClipper: the bounds [L, H] in force across steps, and when new ones take effect.

Why a separate stateful object: the estimator is a pure function of one step's tokens; the
trainer needs period K, smoothing, clamps, fallbacks, checkpointing and the SPEC's timing
("bounds computed from the whole step take effect from the next step; the calibration step
itself trains with the bounds in force when it began"). Usage::

    clipper = CalibratedClipper(cfg, eps_low=0.2, eps_high=0.28)
    for step in range(num_steps):
        lower, upper = clipper.begin_step(step)          # bounds for every loss of this step
        acc = clipper.new_accumulator() if clipper.is_calibration_step(step) else None
        for minibatch in minibatches:
            ...loss with (lower, upper)...; if acc: acc.add(lr8, lr_shadow, adv, mask)
        if acc is not None:
            clipper.update(acc.compute(group=dp_cp_group), step)   # in force from step + 1
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_calibclip.calibration.bounds import CalibrationAccumulator
from megatron_calibclip.calibration.config import CalibrationConfig
from megatron_calibclip.calibration.result import CalibrationResult

STATE_FORMAT = "megatron_calibclip.CalibratedClipper/1"


class CalibratedClipper:
    """Holds [L, H]; turns calibration results into clamped, smoothed, delayed bounds."""

    def __init__(self, config: CalibrationConfig | None = None, *, eps_low: float, eps_high: float) -> None:
        self.config = config if config is not None else CalibrationConfig()
        CalibrationAccumulator.from_config(self.config, eps_low, eps_high)  # validates eps
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self._lower, self._upper = self.config.initial_lower, self.config.initial_upper
        self._pending: tuple[float, float, int] | None = None  # (L, H, first step in force)
        self._step: int | None = None
        self._num_calibrations = 0  # successful ones (the first sets the bounds directly)
        self._num_fallbacks = 0
        self._last_reason: str | None = None
        self._last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ timing
    def is_calibration_step(self, step: int) -> bool:
        """True on steps 0, K, 2K, ...: run the shadow pass and calibrate on this step."""
        return step >= 0 and step % self.config.period == 0

    def begin_step(self, step: int) -> tuple[float, float]:
        """Start `step`: bounds computed during an earlier step come into force; returns (L, H)."""
        if self._pending is not None and step >= self._pending[2]:
            self._lower, self._upper = self._pending[0], self._pending[1]
            self._pending = None
        self._step = step
        return self.bounds

    @property
    def bounds(self) -> tuple[float, float]:
        """(L, H) in force for the current step (ratios, L < 1 < H)."""
        return self._lower, self._upper

    @property
    def next_bounds(self) -> tuple[float, float]:
        """(L, H) that the next step will use (pending update, or the bounds in force)."""
        return (self._pending[0], self._pending[1]) if self._pending is not None else self.bounds

    @property
    def last_reason(self) -> str | None:
        """Why the last calibration fell back (None if it succeeded or none ran)."""
        return self._last_reason

    # ------------------------------------------------------------------ calibration
    def new_accumulator(self, device: torch.device | str | None = None) -> CalibrationAccumulator:
        """An accumulator for the mini-batches of one calibration step, configured like this clipper."""
        return CalibrationAccumulator.from_config(self.config, self.eps_low, self.eps_high, device)

    def calibrate(self, logratio_fp8: torch.Tensor, logratio_bf16: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, *, step: int, group: dist.ProcessGroup | None = None) -> CalibrationResult:
        """One-shot: compute from these tokens (a collective over `group`) and update."""
        acc = self.new_accumulator(logratio_fp8.device)
        acc.add(logratio_fp8, logratio_bf16, advantages, mask)
        result = acc.compute(group)
        self.update(result, step)
        return result

    def update(self, result: CalibrationResult, step: int) -> bool:
        """Apply a result computed during `step`; the new bounds take effect from step + 1.

        Returns False (bounds kept, reason recorded) on a fallback. Raw bounds are clamped,
        then smoothed: L <- beta * L + (1 - beta) * L* (the first success sets them directly).
        """
        cfg = self.config
        self._last_metrics = result.metrics()
        reason = result.reason
        if reason is None and (result.lower is None or result.upper is None
                               or math.isnan(result.lower) or math.isnan(result.upper)):
            reason = "nonfinite_bound: the estimator returned no usable bound"
        if reason is not None:
            self._num_fallbacks += 1
            self._last_reason = reason
            self._last_metrics["calib/fallback"] = 1.0
            return False
        target_l = min(max(result.lower, cfg.lower_min), cfg.lower_max)
        target_h = min(max(result.upper, cfg.upper_min), cfg.upper_max)
        base_l, base_h = self.next_bounds
        if self._num_calibrations == 0:
            new_l, new_h = target_l, target_h
        else:
            beta = cfg.ema_beta
            new_l = beta * base_l + (1.0 - beta) * target_l
            new_h = beta * base_h + (1.0 - beta) * target_h
        self._pending = (new_l, new_h, step + 1)
        self._num_calibrations += 1
        self._last_reason = None
        self._last_metrics.update({"calib/lower_target": target_l, "calib/upper_target": target_h})
        return True

    # ------------------------------------------------------------------ logging
    def metrics(self, prefix: str = "calib/") -> dict[str, float]:
        """Bounds in force / next, counters, and the last result's numbers (for the logger)."""
        next_l, next_h = self.next_bounds
        out = {f"{prefix}{k[len('calib/'):]}": v for k, v in self._last_metrics.items()}
        out.update({
            prefix + "lower_in_force": self._lower,
            prefix + "upper_in_force": self._upper,
            prefix + "lower_next": next_l,
            prefix + "upper_next": next_h,
            prefix + "calibrations": float(self._num_calibrations),
            prefix + "fallbacks": float(self._num_fallbacks),
        })
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain Python values only (safe for torch.save / JSON)."""
        return {
            "format": STATE_FORMAT,
            "lower": self._lower,
            "upper": self._upper,
            "pending": None if self._pending is None else list(self._pending),
            "step": self._step,
            "num_calibrations": self._num_calibrations,
            "num_fallbacks": self._num_fallbacks,
            "last_reason": self._last_reason,
            "last_metrics": dict(self._last_metrics),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly what state_dict() saved (the config stays the constructor's)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a CalibratedClipper state: format {state.get('format')!r}, "
                             f"expected {STATE_FORMAT!r}")
        lower, upper = float(state["lower"]), float(state["upper"])
        if not (0.0 < lower < 1.0 < upper < math.inf):
            raise ValueError(f"invalid bounds in state: lower={lower}, upper={upper}")
        pending = state["pending"]
        self._lower, self._upper = lower, upper
        self._pending = None if pending is None else (float(pending[0]), float(pending[1]), int(pending[2]))
        self._step = None if state["step"] is None else int(state["step"])
        self._num_calibrations = int(state["num_calibrations"])
        self._num_fallbacks = int(state["num_fallbacks"])
        self._last_reason = state["last_reason"]
        self._last_metrics = {str(k): float(v) for k, v in state["last_metrics"].items()}
