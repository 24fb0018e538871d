"""Bounds from a merged calibration histogram: guards, L*, H*, and the refinement passes.

Why separate from the accumulator: filling is local and per mini-batch; solving runs once on
merged (identical on every rank) values, so every branch here, including whether to issue a
second or third all-reduce, is taken identically by all ranks and no rank can hang.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_calibclip.calibration.histogram import DistributedHistogram, all_reduce_histograms, distributed_active
from megatron_calibclip.calibration.result import CalibrationResult

if TYPE_CHECKING:
    from megatron_calibclip.calibration.bounds import CalibrationAccumulator

# Exact sums that ride along in the histogram's all-reduce.
SCALARS = (
    "n_valid",            # mask True
    "n_nonfinite_ratio",  # valid with a non-finite FP8 or shadow log-ratio
    "n_nonfinite_adv",    # valid, finite ratios, non-finite advantage
    "n_neg",
    "n_pos",
    "k_shadow",           # N with log r16 <= log(1 - eps_low)
    "n_neg_fp8_eps",      # N with log r8 <= log(1 - eps_low)
    "n_phantom_eps",      # N with log r8 <= log(1 - eps_low) < log r16
    "n_pos_shadow_eps",   # P with log r16 > log(1 + eps_high)
    "n_pos_fp8_eps",      # P with log r8 > log(1 + eps_high)
    "u_plus_shadow",      # U+(r16, 1 + eps_high)
    "u_minus_shadow",     # U-(r16, 1 - eps_low)
)


# Refinement zooms into at most this many positive slots in its single pass (payload
# <= 2 channels * 8 * refine_bins numbers); wider ranges wait for L* and take a third pass.
MAX_UPPER_ZOOM_SLOTS = 8


def solve(acc: CalibrationAccumulator, hist: DistributedHistogram, group: dist.ProcessGroup | None,
          nbytes: int, ncoll: int) -> CalibrationResult:
    """The result for a merged histogram (nbytes / ncoll: what merging it already cost)."""
    return _Solver(acc, hist, group, nbytes, ncoll).solve()


class _Solver:
    """One compute(): guards, then L*, then H*, optionally refined. Every branch depends only
    on merged (identical on all ranks) values, so all ranks issue the same collectives."""

    def __init__(self, acc: CalibrationAccumulator, hist: DistributedHistogram,
                 group: dist.ProcessGroup | None, nbytes: int, ncoll: int) -> None:
        self.acc, self.hist, self.group = acc, hist, group
        self.nbytes, self.ncoll = nbytes, ncoll
        self.s = {name: hist.scalar(name) for name in SCALARS}

    def _reduce(self, hists: list[DistributedHistogram]) -> None:
        self.nbytes += all_reduce_histograms(hists, self.group)
        self.ncoll += 1 if distributed_active() else 0

    def _guard(self) -> str | None:
        s, acc = self.s, self.acc
        if s["n_nonfinite_ratio"] > 0:
            return (f"nonfinite_ratio: {int(s['n_nonfinite_ratio'])} unmasked token(s) have a "
                    "non-finite FP8 or shadow log-ratio")
        if s["n_nonfinite_adv"] > 0:
            return f"nonfinite_advantage: {int(s['n_nonfinite_adv'])} unmasked token(s) have a non-finite advantage"
        if s["n_neg"] == 0:
            return "no_negative_tokens: no valid token has A < 0"
        if s["k_shadow"] == 0:
            return f"alpha_zero: the shadow clips no negative token (r <= {1 - acc.eps_low:g})"
        masses = [s["u_plus_shadow"], s["u_minus_shadow"],
                  self.hist.total(acc.neg_mass_channel), self.hist.total(acc.pos_mass_channel)]
        if not all(math.isfinite(m) for m in masses):
            return "nonfinite_mass: an effective update mass overflowed (|A| * exp(log r) is inf)"
        if s["n_pos"] == 0:
            return "no_positive_tokens: no valid token has A > 0, H cannot be rebalanced"
        if s["u_minus_shadow"] <= 0:
            return "alpha_one: the shadow clips every negative token, p_bf16 is undefined"
        return None

    def solve(self) -> CalibrationResult:
        s, acc, hist = self.s, self.acc, self.hist
        reason = self._guard()
        n_neg, n_pos = s["n_neg"], s["n_pos"]
        alpha = s["k_shadow"] / n_neg if n_neg > 0 else None
        p = s["u_plus_shadow"] / s["u_minus_shadow"] if s["u_minus_shadow"] > 0 else None
        log_l = log_h = neg_at_l = pos_at_h = None
        if reason is None:
            log_l, log_h, neg_at_l, pos_at_h = self._bounds(int(s["k_shadow"]), p)
        frac = lambda num, den: (num / den) if den > 0 else None  # noqa: E731
        return CalibrationResult(
            lower=None if log_l is None else math.exp(log_l),
            upper=None if log_h is None else math.exp(log_h),
            log_lower=log_l, log_upper=log_h, alpha=alpha, p_bf16=p,
            n_valid=int(s["n_valid"]), n_neg=int(n_neg), n_pos=int(n_pos),
            n_neg_clipped_shadow=int(s["k_shadow"]),
            n_nonfinite=int(s["n_nonfinite_ratio"] + s["n_nonfinite_adv"]),
            reason=reason, mass=acc.mass, shadow_precision=acc.shadow_precision, refined=acc.refine,
            resolution=hist.width / acc.refine_bins if acc.refine else hist.width,
            num_collectives=self.ncoll, bytes_communicated=self.nbytes,
            neg_clip_frac_fp8_eps=frac(s["n_neg_fp8_eps"], n_neg),
            phantom_clip_frac_eps=frac(s["n_phantom_eps"], n_neg),
            pos_clip_frac_shadow_eps=frac(s["n_pos_shadow_eps"], n_pos),
            pos_clip_frac_fp8_eps=frac(s["n_pos_fp8_eps"], n_pos),
            neg_clip_frac_fp8_lower=None if neg_at_l is None else neg_at_l / n_neg,
            pos_clip_frac_fp8_upper=None if pos_at_h is None else 1.0 - pos_at_h / n_pos,
        )

    def _bounds(self, k: int, p: float) -> tuple[float, float, float, float]:
        """(log L*, log H*, #N with r8 <= L*, #P with r8 <= H*)."""
        acc, hist = self.acc, self.hist
        mass_n, mass_p = acc.neg_mass_channel, acc.pos_mass_channel
        slot_l = hist.locate("neg_count", k)
        slot_h = hist.locate(mass_p, p * hist.above(mass_n, slot_l))
        if not acc.refine:
            return (hist.right_edge(slot_l), hist.right_edge(slot_h),
                    hist.at_most("neg_count", slot_l), hist.at_most("pos_count", slot_h))
        interior = lambda slot: 1 <= slot <= hist.bins  # noqa: E731
        neg_channels, pos_channels = ("neg_count", mass_n), ("pos_count", mass_p)
        zoom_l = hist.zoom(slot_l, acc.refine_bins, neg_channels) if interior(slot_l) else None
        # H*'s slot is not known yet: the negative mass inside L's slot that lies above the
        # refined L* is unknown, so the target p * U- is only known to lie in [t_lo, t_hi].
        # Zoom into every positive slot that range can reach (a few at most), in the same pass.
        first_h = last_h = slot_h
        if zoom_l is not None:
            last_h = hist.locate(mass_p, p * hist.above(mass_n, slot_l - 1))
        first_h, last_h = max(first_h, 1), min(last_h, hist.bins)
        zoom_h = None
        if first_h <= last_h and last_h - first_h < MAX_UPPER_ZOOM_SLOTS:
            zoom_h = hist.zoom((first_h, last_h), acc.refine_bins, pos_channels)
        pending = [z for z in (zoom_l, zoom_h) if z is not None]
        if pending:
            self._reduce(pending)
        if zoom_l is not None:
            sub = zoom_l.locate("neg_count", k)
            log_l, neg_at_l = zoom_l.right_edge(sub), zoom_l.at_most("neg_count", sub)
            target = p * zoom_l.above(mass_n, sub)
        else:
            log_l, neg_at_l = hist.right_edge(slot_l), hist.at_most("neg_count", slot_l)
            target = p * hist.above(mass_n, slot_l)
        slot_h = hist.locate(mass_p, target)
        if not interior(slot_h):  # below / above the range: lo or +inf, nothing to refine
            return log_l, hist.right_edge(slot_h), neg_at_l, hist.at_most("pos_count", slot_h)
        if zoom_h is None or not first_h <= slot_h <= last_h:  # the target moved too far: third pass
            zoom_h = hist.zoom(slot_h, acc.refine_bins, pos_channels)
            self._reduce([zoom_h])
        sub = zoom_h.locate(mass_p, target)
        return log_l, zoom_h.right_edge(sub), neg_at_l, zoom_h.at_most("pos_count", sub)
