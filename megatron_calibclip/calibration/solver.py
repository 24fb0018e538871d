"""Bounds from a merged calibration histogram: guards, L*, H* by the chosen rule, refinement.

Why separate from the accumulator: filling is local and per mini-batch; solving runs once on
merged (identical on every rank) values, so every branch here, including whether to issue a
second or third all-reduce, is taken identically by all ranks and no rank can hang.

Order of a solve: guards on the merged counts -> L* (k-th FP8 order statistic of N, refined)
-> L used (L* capped at 1 - eps_low when widen-only) -> H* for that L by the rule -> the
positive-tail guard -> H used (raised to 1 + eps_high when widen-only). Every way to fail is a
fallback with a reason (CalibrationResult.reason); nothing is silently clamped.
"""
from __future__ import annotations

import math

import torch.distributed as dist

from megatron_calibclip.calibration.histogram import DistributedHistogram, all_reduce_histograms, distributed_active
from megatron_calibclip.calibration.result import CalibrationResult
from megatron_calibclip.calibration.spec import SolveSpec

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
    "u_plus_shadow_all",  # U+(r16, inf)
    "u_minus_shadow",     # U-(r16, 1 - eps_low): N with 1 - eps_low < r16 <= c (dual-clip)
    "u_minus_fp8_eps",    # U-(r8, 1 - eps_low): N with 1 - eps_low < r8 <= c
    "u_minus_fp8_dual",   # mass of N with r8 > c (no gradient under dual-clip; 0 without)
)

# Refinement zooms into at most this many positive slots in its single pass (payload
# <= 2 channels * 8 * refine_bins numbers); wider ranges wait for L* and take a third pass.
MAX_UPPER_ZOOM_SLOTS = 8


class _Fallback(Exception):
    """A guard failed after the merge: the calibration falls back with this reason."""


def solve(spec: SolveSpec, hist: DistributedHistogram, group: dist.ProcessGroup | None,
          nbytes: int, ncoll: int) -> CalibrationResult:
    """The result for a merged histogram (nbytes / ncoll: what merging it already cost)."""
    return _Solver(spec, hist, group, nbytes, ncoll).solve()


class _Solver:
    """One compute(). Every branch depends only on merged (identical on all ranks) values,
    so all ranks issue the same collectives."""

    def __init__(self, spec: SolveSpec, hist: DistributedHistogram,
                 group: dist.ProcessGroup | None, nbytes: int, ncoll: int) -> None:
        self.spec, self.hist, self.group = spec, hist, group
        self.nbytes, self.ncoll = nbytes, ncoll
        self.s = {name: hist.scalar(name) for name in SCALARS}
        self.raw: dict[str, float | None] = {"log_lower_raw": None, "log_upper_raw": None}

    def _reduce(self, hists: list[DistributedHistogram]) -> None:
        self.nbytes += all_reduce_histograms(hists, self.group)
        self.ncoll += 1 if distributed_active() else 0

    # ------------------------------------------------------------------ guards
    def _guard(self) -> str | None:
        s, spec = self.s, self.spec
        if s["n_nonfinite_ratio"] > 0:
            return (f"nonfinite_ratio: {int(s['n_nonfinite_ratio'])} unmasked token(s) have a "
                    "non-finite FP8 or shadow log-ratio")
        if s["n_nonfinite_adv"] > 0:
            return f"nonfinite_advantage: {int(s['n_nonfinite_adv'])} unmasked token(s) have a non-finite advantage"
        if s["n_neg"] == 0:
            return "no_negative_tokens: no valid token has A < 0"
        if s["k_shadow"] == 0:
            return f"alpha_zero: the shadow clips no negative token (r <= {1 - spec.eps_low:g})"
        if s["k_shadow"] < spec.min_clipped_tokens:
            return (f"too_few_clipped_negative: the shadow clips {int(s['k_shadow'])} of {int(s['n_neg'])} "
                    f"negative tokens, fewer than min_clipped_tokens={spec.min_clipped_tokens}")
        if not spec.reads_positive_tail:
            return None
        masses = [s["u_plus_shadow"], s["u_plus_shadow_all"], s["u_minus_shadow"], s["u_minus_fp8_eps"],
                  s["u_minus_fp8_dual"], self.hist.total(spec.neg_mass_channel), self.hist.total(spec.pos_mass_channel)]
        if not all(math.isfinite(m) for m in masses):
            return "nonfinite_mass: an effective update mass overflowed (|A| * exp(log r) is inf)"
        if s["n_pos"] == 0:
            return "no_positive_tokens: no valid token has A > 0, H cannot be rebalanced"
        if spec.upper_rule == "mass_balance" and s["u_minus_shadow"] <= 0:
            return "alpha_one: the shadow clips every negative token, p_bf16 is undefined"
        if spec.upper_rule == "quantile" and s["n_pos_shadow_eps"] < spec.min_clipped_tokens:
            return (f"too_few_clipped_positive: the shadow clips {int(s['n_pos_shadow_eps'])} of "
                    f"{int(s['n_pos'])} positive tokens, fewer than min_clipped_tokens={spec.min_clipped_tokens}")
        return None

    @staticmethod
    def _check_range(name: str, log_value: float, lo: float, hi: float) -> None:
        """Fall back unless lo <= log_value <= hi (log space; an infinite bound never passes)."""
        if not (math.isfinite(log_value) and lo <= log_value <= hi):
            raise _Fallback(f"{name}_out_of_range: the calibrated {name} bound {math.exp(log_value):.4g} "
                            f"is outside the plausible range [{math.exp(lo):.4g}, {math.exp(hi):.4g}]")

    # ------------------------------------------------------------------ solve
    def solve(self) -> CalibrationResult:
        s, spec, hist = self.s, self.spec, self.hist
        reason = self._guard()
        n_neg, n_pos = s["n_neg"], s["n_pos"]
        alpha = s["k_shadow"] / n_neg if n_neg > 0 else None
        beta = s["n_pos_shadow_eps"] / n_pos if n_pos > 0 else None
        p = s["u_plus_shadow"] / s["u_minus_shadow"] if s["u_minus_shadow"] > 0 else None
        log_l = log_h = neg_at_l = pos_at_h = None
        if reason is None:
            try:
                log_l, log_h, neg_at_l, pos_at_h = self._bounds(int(s["k_shadow"]), p)
            except _Fallback as fb:
                reason = str(fb)
                log_l = log_h = neg_at_l = pos_at_h = None
        frac = lambda num, den: (num / den) if den > 0 else None  # noqa: E731
        raw_l, raw_h = self.raw["log_lower_raw"], self.raw["log_upper_raw"]
        return CalibrationResult(
            lower=None if log_l is None else math.exp(log_l),
            upper=None if log_h is None else math.exp(log_h),
            log_lower=log_l, log_upper=log_h, alpha=alpha, p_bf16=p,
            n_valid=int(s["n_valid"]), n_neg=int(n_neg), n_pos=int(n_pos),
            n_neg_clipped_shadow=int(s["k_shadow"]),
            n_nonfinite=int(s["n_nonfinite_ratio"] + s["n_nonfinite_adv"]),
            reason=reason, mass=spec.mass, shadow_precision=spec.shadow_precision, refined=spec.refine,
            resolution=hist.width / spec.refine_bins if spec.refine else hist.width,
            num_collectives=self.ncoll, bytes_communicated=self.nbytes,
            neg_clip_frac_fp8_eps=frac(s["n_neg_fp8_eps"], n_neg),
            phantom_clip_frac_eps=frac(s["n_phantom_eps"], n_neg),
            pos_clip_frac_shadow_eps=frac(s["n_pos_shadow_eps"], n_pos),
            pos_clip_frac_fp8_eps=frac(s["n_pos_fp8_eps"], n_pos),
            neg_clip_frac_fp8_lower=None if neg_at_l is None else neg_at_l / n_neg,
            pos_clip_frac_fp8_upper=None if pos_at_h is None or n_pos == 0 else 1.0 - pos_at_h / n_pos,
            upper_rule=spec.upper_rule, beta=beta,
            n_pos_clipped_shadow=int(s["n_pos_shadow_eps"]),
            log_lower_raw=raw_l, log_upper_raw=raw_h,
        )

    def _bounds(self, k: int, p: float | None) -> tuple[float, float, float, float]:
        """(log L, log H, #N with r8 <= L, #P with r8 <= H) for the bounds to use."""
        spec, hist = self.spec, self.hist
        interior = lambda slot: 1 <= slot <= hist.bins  # noqa: E731
        slot_l = hist.locate("neg_count", k)
        neg_channels = ("neg_count", spec.neg_mass_channel)
        zoom_l = hist.zoom(slot_l, spec.refine_bins, neg_channels) if spec.refine and interior(slot_l) else None
        # H's slot, when it can be known before L* (rules that do not depend on L, or
        # mass_balance's range of reachable slots): zoomed in the same pass as L*
        first_h, last_h = self._upper_slots_before_l(slot_l, zoom_l is not None, p)
        zoom_h = None
        if spec.refine and first_h is not None:
            first_h, last_h = max(first_h, 1), min(last_h, hist.bins)
            if first_h <= last_h and last_h - first_h < MAX_UPPER_ZOOM_SLOTS:
                zoom_h = hist.zoom((first_h, last_h), spec.refine_bins, ("pos_count", spec.pos_mass_channel))
        pending = [z for z in (zoom_l, zoom_h) if z is not None]
        if pending:
            self._reduce(pending)
        if zoom_l is not None:
            sub = zoom_l.locate("neg_count", k)
            log_l_star, neg_at_l = zoom_l.right_edge(sub), zoom_l.at_most("neg_count", sub)
            u_minus_above = zoom_l.above(spec.neg_mass_channel, sub)
        else:
            log_l_star, neg_at_l = hist.right_edge(slot_l), hist.at_most("neg_count", slot_l)
            u_minus_above = hist.above(spec.neg_mass_channel, slot_l)
        self.raw["log_lower_raw"] = log_l_star
        lo_l, hi_l = spec.log_lower_range
        if spec.widen_only:  # an L* tighter than the host's is replaced by the host's bound
            self._check_range("lower", log_l_star, lo_l, math.inf)
            log_l = min(log_l_star, spec.t_low)
        else:
            log_l = log_l_star
        self._check_range("lower", log_l, lo_l, hi_l)
        if log_l != log_l_star:  # exact counts at the host's threshold
            neg_at_l, u_minus = self.s["n_neg_fp8_eps"], self.s["u_minus_fp8_eps"]
        else:
            u_minus = u_minus_above - self.s["u_minus_fp8_dual"]  # dual-clipped: no gradient
        if spec.upper_rule == "host":  # L-only: H stays the host's bound (exact counts there)
            log_h_star = spec.t_high
            pos_at_h_star = self.s["n_pos"] - self.s["n_pos_fp8_eps"]
        elif spec.upper_rule == "log_scale":
            log_h_star = spec.t_high * log_l / spec.t_low
            pos_at_h_star = hist.at_most("pos_count", hist.locate_value(log_h_star))  # within one bin
        else:
            if spec.upper_rule == "mass_balance":
                channel, target = spec.pos_mass_channel, p * u_minus
                total = hist.total(channel)
                if target > total * (1.0 + hist.rtol):
                    raise _Fallback(
                        f"upper_infeasible: p_bf16 * U-(r8, L) = {target:.4g} exceeds the whole positive "
                        f"FP8 mass {total:.4g}: no finite H balances the update masses")
            else:
                channel, target = self._upper_target()
            log_h_star, pos_at_h_star = self._locate_upper(channel, target, zoom_h, first_h, last_h)
        self.raw["log_upper_raw"] = log_h_star
        lo_h, hi_h = spec.log_upper_range
        self._check_range("upper", log_h_star, -math.inf if spec.widen_only else lo_h, hi_h)
        n_above = self.s["n_pos"] - pos_at_h_star
        if spec.reads_positive_tail and n_above < spec.min_clipped_tokens:
            raise _Fallback(
                f"upper_from_few_tokens: {int(n_above)} positive token(s) lie above H* = "
                f"{math.exp(log_h_star):.4g} under FP8, fewer than min_clipped_tokens={spec.min_clipped_tokens}")
        # an H* tighter than the host's is replaced by the host's bound under widen-only
        log_h = max(log_h_star, spec.t_high) if spec.widen_only else log_h_star
        self._check_range("upper", log_h, lo_h, hi_h)
        pos_at_h = pos_at_h_star if log_h == log_h_star else self.s["n_pos"] - self.s["n_pos_fp8_eps"]
        return log_l, log_h, neg_at_l, pos_at_h

    def _upper_target(self) -> tuple[str, float]:
        """(channel, target) of the L-independent tail rules: H = smallest h reaching target."""
        spec, s, hist = self.spec, self.s, self.hist
        if spec.upper_rule == "quantile":  # FP8 keeps as many A>0 tokens as the shadow does
            return "pos_count", s["n_pos"] - s["n_pos_shadow_eps"]
        share = s["u_plus_shadow"] / s["u_plus_shadow_all"]  # mass_fraction
        return spec.pos_mass_channel, share * hist.total(spec.pos_mass_channel)

    def _upper_slots_before_l(self, slot_l: int, l_refined: bool, p: float | None) -> tuple[int | None, int | None]:
        """Slots H* can fall in, as known from the first pass (None: not known before L*)."""
        spec, hist = self.spec, self.hist
        if spec.upper_rule in ("log_scale", "host"):  # closed forms: no positive slot to zoom into
            return None, None
        if spec.upper_rule != "mass_balance":
            channel, target = self._upper_target()
            slot = hist.locate(channel, target)
            return slot, slot
        dual = self.s["u_minus_fp8_dual"]
        mass_n, mass_p = spec.neg_mass_channel, spec.pos_mass_channel
        # The negative mass inside L's slot that lies above the refined L* is unknown, so the
        # target p * U- is only known to lie in a range; zoom into every slot it can reach.
        first = hist.locate(mass_p, p * (hist.above(mass_n, slot_l) - dual))
        last = hist.locate(mass_p, p * (hist.above(mass_n, slot_l - 1) - dual)) if l_refined else first
        return first, last

    def _locate_upper(self, channel: str, target: float, zoom_h: DistributedHistogram | None,
                      first_h: int | None, last_h: int | None) -> tuple[float, float]:
        """(log H*, #P with r8 <= H*) for the smallest grid h whose cumulative `channel` reaches target."""
        hist = self.hist
        slot = hist.locate(channel, target)
        if not self.spec.refine or not 1 <= slot <= hist.bins:  # below / above the range: lo or +inf
            return hist.right_edge(slot), hist.at_most("pos_count", slot)
        if zoom_h is None or not first_h <= slot <= last_h:  # the target moved too far: one more pass
            zoom_h = hist.zoom(slot, self.spec.refine_bins, ("pos_count", self.spec.pos_mass_channel))
            self._reduce([zoom_h])
        sub = zoom_h.locate(channel, target)
        return zoom_h.right_edge(sub), zoom_h.at_most("pos_count", sub)
