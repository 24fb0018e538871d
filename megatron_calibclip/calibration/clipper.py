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
            clipper.compute(acc, step, group=dp_cp_group)          # in force from step + 1

With `pool_calibrations` m > 1 the clipper also keeps the merged histogram sums of the last
m - 1 calibrated periods (identical on every rank; in its checkpointed state) and solves each
calibration on them together with the new step's. A period is the K steps from a scheduled
calibration to the next; with `retry_on_scarce_data` a period's retries stay inside it, and
the pool keeps one step per period (its latest with A < 0 tokens), as the schedule would read.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_calibclip.calibration.bounds import CalibrationAccumulator
from megatron_calibclip.calibration.config import CalibrationConfig
from megatron_calibclip.calibration.result import CalibrationResult
from megatron_calibclip.calibration.solver import SCALARS
from megatron_calibclip.parallel.devices import HOST

STATE_FORMAT = "megatron_calibclip.CalibratedClipper/1"  # later fields are optional in it
# fallbacks for lack of data (reason codes): retry_on_scarce_data calibrates again next step
SCARCE_DATA = ("no_negative_tokens", "alpha_zero", "too_few_clipped_negative")
logger = logging.getLogger(__name__)


class CalibratedClipper:
    """Holds [L, H]; turns calibration results into clamped, smoothed, delayed bounds."""

    def __init__(self, config: CalibrationConfig | None = None, *, eps_low: float, eps_high: float,
                 dual_clip_c: float | None = None) -> None:
        self.config = config if config is not None else CalibrationConfig()
        self.dual_clip_c = dual_clip_c  # the loss's dual-clip c (None: off): counted as the loss counts it
        CalibrationAccumulator.from_config(self.config, eps_low, eps_high, dual_clip_c=dual_clip_c)  # validates
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        # upper_rule "host" (L-only): H is the host's bound on every step, exactly as fixed clipping has it
        self._host_upper = 1.0 + self.eps_high if self.config.upper_rule == "host" else None
        self._lower = self.config.initial_lower
        self._upper = self.config.initial_upper if self._host_upper is None else self._host_upper
        self._pending: tuple[float, float, int] | None = None  # (L, H, first step in force)
        self._step: int | None = None
        self._num_calibrations = 0  # successful ones (the first sets the bounds directly)
        self._num_fallbacks = 0
        self._last_reason: str | None = None
        self._last_metrics: dict[str, float] = {}
        self._last_labels: dict[str, str] = {}
        self._pool: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (period, merged sums), oldest first
        # retry_on_scarce_data: calibrate on every step in [retry_from, retry_until)
        self._retry_from: int | None = None
        self._retry_until: int | None = None

    # ------------------------------------------------------------------ timing
    def is_calibration_step(self, step: int) -> bool:
        """True on steps 0, K, 2K, ...: run the shadow pass and calibrate on this step; with
        retry_on_scarce_data also on the steps after a fallback for lack of data, until a
        calibration runs with enough, at most `max_retries` steps after the scheduled one (a
        step the trainer skips does not lose the retry, but the retry ends with its period)."""
        if self._retry_from is not None and self._retry_from <= step < self._retry_until:
            return True
        return step >= 0 and step % self.config.period == 0

    def _retry_window(self, step: int) -> tuple[int, int] | None:
        """[first, end) of the retries after a fallback for lack of data on `step` (None: none left)."""
        end = (step // self.config.period) * self.config.period + self.config.max_retries + 1
        return (step + 1, end) if step + 1 < end else None

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
        acc = CalibrationAccumulator.from_config(self.config, self.eps_low, self.eps_high, device,
                                                 dual_clip_c=self.dual_clip_c)
        if self.config.record_dir is not None:
            acc.recorded = []
        return acc

    def calibrate(self, logratio_fp8: torch.Tensor, logratio_bf16: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, *, step: int, group: dist.ProcessGroup | None = None) -> CalibrationResult:
        """One-shot: compute from these tokens (a collective over `group`) and update."""
        acc = self.new_accumulator(logratio_fp8.device)
        acc.add(logratio_fp8, logratio_bf16, advantages, mask)
        return self.compute(acc, step, group=group)

    def compute(self, acc: CalibrationAccumulator, step: int,
                group: dist.ProcessGroup | None = None) -> CalibrationResult:
        """Compute `acc` (a collective over `group`) pooled with the kept earlier periods, then
        update; keeps this step's merged sums for the next ones (pool_calibrations), in place of
        an earlier attempt of the same period (a retry reads what the schedule would have)."""
        keep = self.config.pool_calibrations - 1
        period = step // self.config.period
        earlier = [entry for entry in self._pool if entry[0] != period][-keep:] if keep > 0 else []
        result = acc.compute(group, pool=[(data, scalars) for _, data, scalars in earlier], keep_merged=keep > 0)
        if keep > 0 and acc.merged_sums is not None and _poolable(acc.merged_sums[1]):
            self._pool = (earlier + [(period, *acc.merged_sums)])[-keep:]
        self.update(result, step)
        return result

    def update(self, result: CalibrationResult, step: int) -> bool:
        """Apply a result computed during `step`; the new bounds take effect from step + 1.

        Returns False (bounds kept, reason recorded) on a fallback. Bounds are smoothed, in log
        space by default: log L <- beta log L + (1 - beta) log L* (the first success sets them
        directly). The clamp to [lower_min, lower_max] x [upper_min, upper_max] is only a last
        safety net: the solver already falls back on bounds outside that range.
        """
        cfg = self.config
        self._last_metrics = result.metrics()
        self._last_labels = result.labels()
        reason = result.reason
        if reason is None and (result.lower is None or result.upper is None
                               or not math.isfinite(result.lower) or not math.isfinite(result.upper)):
            reason = "nonfinite_bound: the estimator returned no finite bound"  # never clamped
        scarce = reason is not None and reason.split(":", 1)[0] in SCARCE_DATA
        window = self._retry_window(step) if scarce else None
        self._retry_from, self._retry_until = window if window is not None else (None, None)
        if reason is not None:
            self._num_fallbacks += 1
            self._last_reason = reason
            self._last_metrics["calib/fallback"] = 1.0
            self._last_labels["calib/fallback_reason"] = reason
            return False
        target_l = min(max(result.lower, cfg.lower_min), cfg.lower_max)
        target_h = min(max(result.upper, cfg.upper_min), cfg.upper_max)
        base_l, base_h = self.next_bounds
        if self._num_calibrations == 0:
            new_l, new_h = target_l, target_h
        else:
            new_l = _ema(base_l, target_l, cfg.ema_beta, cfg.smoothing)
            new_h = _ema(base_h, target_h, cfg.ema_beta, cfg.smoothing)
        if self._host_upper is not None:  # exactly the host's bound (the solver's is exp(log1p(eps_high)))
            target_h = new_h = self._host_upper
        self._pending = (new_l, new_h, step + 1)
        self._num_calibrations += 1
        self._last_reason = None
        self._last_metrics.update({"calib/lower_target": target_l, "calib/upper_target": target_h})
        return True

    def save_inputs(self, acc: CalibrationAccumulator, step: int, result: CalibrationResult,
                    group: dist.ProcessGroup | None = None) -> Path | None:
        """Write the inputs `acc` recorded (config.record_dir) for offline study; one file per
        rank of `group` (ranks holding the same shard write the same file, atomically)."""
        if self.config.record_dir is None or acc.recorded is None:
            return None
        index = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        folder = Path(self.config.record_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step{step:06d}_rank{index:03d}.pt"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"step": step, "eps_low": self.eps_low, "eps_high": self.eps_high,
                    "dual_clip_c": self.dual_clip_c, "minibatches": acc.recorded,
                    "result": dataclasses.asdict(result)}, tmp)
        os.replace(tmp, path)
        return path

    # ------------------------------------------------------------------ logging
    def metrics(self, prefix: str = "calib/") -> dict[str, float | str]:
        """Bounds in force / next, counters, the last result's numbers and its rule and
        fallback reason as strings (for the JSONL logger; TensorBoard keeps the numbers)."""
        next_l, next_h = self.next_bounds
        out: dict[str, float | str] = {f"{prefix}{k[len('calib/'):]}": v for k, v in self._last_metrics.items()}
        out.update({f"{prefix}{k[len('calib/'):]}": v for k, v in self._last_labels.items()})
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
            "last_labels": dict(self._last_labels),
            "pool": [{**_sparse(data, scalars), "period": period} for period, data, scalars in self._pool],
            "pool_layout": self._layout(),
            "retry_from": self._retry_from,
            "retry_until": self._retry_until,
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
        self._last_labels = {str(k): str(v) for k, v in state.get("last_labels", {}).items()}
        # states saved before pooling existed have no "pool"; a smaller pool_calibrations than the
        # saved run's keeps the newest entries
        retry = state.get("retry_from")  # absent in states saved before the option existed
        self._retry_from = None if retry is None else int(retry)
        until = state.get("retry_until")  # absent before the retries were capped: end of the period
        if self._retry_from is not None and until is None:
            window = self._retry_window(self._retry_from - 1)
            until = None if window is None else window[1]
        self._retry_until = None if until is None else int(until)
        if self._retry_until is None:
            self._retry_from = None
        keep = self.config.pool_calibrations - 1
        saved = state.get("pool", [])
        # entries saved before periods were recorded: one step each, all from earlier periods
        pool = [(int(entry.get("period", i - len(saved))), *_dense(entry)) for i, entry in enumerate(saved)]
        if pool and state.get("pool_layout") != self._layout():
            logger.warning("calibration pool not restored: it was saved with the histogram layout %s, "
                           "this run's is %s; the next calibrations pool from scratch",
                           state.get("pool_layout"), self._layout())
            pool = []
        self._pool = pool[max(0, len(pool) - keep):] if keep > 0 else []

    def _layout(self) -> dict[str, Any]:
        return self.new_accumulator().layout


def _poolable(scalars: torch.Tensor) -> bool:
    """Whether a step's merged sums may join the pool: it has A < 0 tokens (a step without any
    would take a slot and add nothing) and no non-finite one (such a step falls back on its
    own, and pooled it would make the next calibrations fall back too)."""
    value = lambda name: float(scalars[SCALARS.index(name)])  # noqa: E731
    return value("n_neg") > 0 and value("n_nonfinite_ratio") == 0 and value("n_nonfinite_adv") == 0


def _sparse(data: torch.Tensor, scalars: torch.Tensor) -> dict[str, Any]:
    """A pooled step's merged sums as plain Python values (nonzero slots only: a small batch
    fills few of the 16k bins)."""
    flat = data.reshape(-1)
    index = torch.nonzero(flat).reshape(-1)
    return {"shape": list(data.shape), "index": index.tolist(), "value": flat[index].tolist(),
            "scalars": scalars.tolist()}


def _dense(entry: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    shape = [int(n) for n in entry["shape"]]
    flat = torch.zeros(math.prod(shape), dtype=torch.float64, device=HOST)
    flat[torch.tensor(entry["index"], dtype=torch.long, device=HOST)] = torch.tensor(
        entry["value"], dtype=torch.float64, device=HOST)
    return flat.reshape(shape), torch.tensor(entry["scalars"], dtype=torch.float64, device=HOST)


def _ema(old: float, new: float, beta: float, space: str) -> float:
    """beta * old + (1 - beta) * new, of the logs (space "log") or of the values ("linear")."""
    if space == "log":
        return math.exp(beta * math.log(old) + (1.0 - beta) * math.log(new))
    return beta * old + (1.0 - beta) * new
