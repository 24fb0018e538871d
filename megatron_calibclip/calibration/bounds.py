"""Calibrated bounds [L*, H*] from FP8 and shadow log-ratios pooled over a process group.

Why an accumulator: the shadow pass covers every PPO mini-batch of a calibration step, so the
tokens of several mini-batches are added into one histogram and the bounds are computed once,
with one all-reduce plus, with `refine` (the default), one more, rarely two (see solver.py).
The math is the SPEC's:

  N = valid tokens with A < 0, P = valid tokens with A > 0 (A == 0 and masked tokens ignored)
  alpha = #{N: log r16 <= log(1 - eps_low)} / |N| = k / |N|                (exact counts)
  L*    = smallest grid point l with #{N: log r8 <= l} >= k                (k-th order stat, rounded up)
  L     = min(L*, 1 - eps_low) with widen_only (the default), else L*
  H*    = by `upper_rule` (config.py; the default log_scale: log H* = log(1+eps_high) log L / log(1-eps_low);
          host: H* = 1 + eps_high, only L calibrated),
          e.g. mass_balance (the SPEC's): smallest grid h with U+(r8, h) >= p * U-(r8, L),
          p = U+(r16, 1 + eps_high) / U-(r16, 1 - eps_low)                 (exact sums)
  H     = max(H*, 1 + eps_high) with widen_only, else H*
  U+(x, h) = sum_P m * 1[x <= h],  U-(x, l) = sum_N m * 1[l < x <= c],  m = |A| r or 1,
  c = the loss's dual-clip constant (+inf without dual-clip: such tokens get no gradient).
Guards (solver.py): fewer than min_clipped_tokens clipped tokens behind a quantile, an
infeasible target, or a bound outside the plausible range is a fallback with a reason.

U- counts a negative token as unclipped when r > l, consistent with "clipped = r <= l"; the
SPEC writes 1[x >= l], which differs only for ratios exactly equal to l. L* is a grid point
(not interpolated) so that U-(r8, L*) is an exact suffix sum of the merged histogram: H* is
then exact on the grid for the L* actually returned. See README.md.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_calibclip.calibration.config import CalibrationConfig
from megatron_calibclip.calibration.histogram import DistributedHistogram, all_reduce_histograms, distributed_active
from megatron_calibclip.calibration.result import CalibrationResult
from megatron_calibclip.calibration.solver import SCALARS, solve
from megatron_calibclip.calibration.spec import SolveSpec
from megatron_calibclip.parallel.devices import collective_device

_DEFAULTS = CalibrationConfig()


class CalibrationAccumulator:
    """Adds the mini-batches of one calibration step, then computes the bounds once.

    `compute` is a collective over `group`: every rank must call it (a rank without valid
    tokens still calls it, possibly without any `add`). Keyword defaults are
    CalibrationConfig's; `dual_clip_c` is the loss's (None: no dual-clip).
    """

    def __init__(
        self,
        eps_low: float,
        eps_high: float,
        *,
        mass: str = _DEFAULTS.mass,
        shadow_precision: str = _DEFAULTS.shadow_precision,
        upper_rule: str = _DEFAULTS.upper_rule,
        min_clipped_tokens: int = _DEFAULTS.min_clipped_tokens,
        widen_only: bool = _DEFAULTS.widen_only,
        dual_clip_c: float | None = None,
        lower_min: float = _DEFAULTS.lower_min,
        lower_max: float = _DEFAULTS.lower_max,
        upper_min: float = _DEFAULTS.upper_min,
        upper_max: float = _DEFAULTS.upper_max,
        log_ratio_min: float = _DEFAULTS.log_ratio_min,
        log_ratio_max: float = _DEFAULTS.log_ratio_max,
        bins: int = _DEFAULTS.bins,
        refine: bool = _DEFAULTS.refine,
        refine_bins: int = _DEFAULTS.refine_bins,
        mass_rtol: float = _DEFAULTS.mass_rtol,
        device: torch.device | str | None = None,
    ) -> None:
        self.spec = SolveSpec(
            float(eps_low), float(eps_high), mass=mass, shadow_precision=shadow_precision,
            upper_rule=upper_rule, min_clipped_tokens=min_clipped_tokens, widen_only=bool(widen_only),
            dual_clip_c=dual_clip_c, lower_min=lower_min, lower_max=lower_max, upper_min=upper_min,
            upper_max=upper_max, refine=bool(refine), refine_bins=int(refine_bins),
        )
        spec = self.spec
        self.eps_low, self.eps_high = spec.eps_low, spec.eps_high
        channels = ("neg_count", "pos_count") + (("neg_mass", "pos_mass") if mass == "abs_adv_ratio" else ())
        self._hist_args = dict(
            lo=log_ratio_min, hi=log_ratio_max, bins=bins, channels=channels, scalars=SCALARS,
            keep_samples=spec.refine, rtol=mass_rtol,
        )
        DistributedHistogram(**self._hist_args)  # validate the grid now, not at compute time
        self._device = torch.device(device) if device is not None else None
        self._hist: DistributedHistogram | None = None
        self._done = False
        self.recorded: list[dict[str, torch.Tensor]] | None = None  # set to [] to keep inputs
        self.merged_sums: tuple[torch.Tensor, torch.Tensor] | None = None  # set by compute()

    @property
    def layout(self) -> dict[str, Any]:
        """The histogram's grid, channels and scalars: merged sums pool only within one layout."""
        args = self._hist_args
        return {"lo": args["lo"], "hi": args["hi"], "bins": args["bins"],
                "channels": list(args["channels"]), "scalars": list(args["scalars"])}

    @classmethod
    def from_config(cls, config: CalibrationConfig, eps_low: float, eps_high: float,
                    device: torch.device | str | None = None, *,
                    dual_clip_c: float | None = None) -> CalibrationAccumulator:
        return cls(
            eps_low, eps_high, mass=config.mass, shadow_precision=config.shadow_precision,
            upper_rule=config.upper_rule, min_clipped_tokens=config.min_clipped_tokens,
            widen_only=config.widen_only, dual_clip_c=dual_clip_c, lower_min=config.lower_min,
            lower_max=config.lower_max, upper_min=config.upper_min, upper_max=config.upper_max,
            log_ratio_min=config.log_ratio_min, log_ratio_max=config.log_ratio_max, bins=config.bins,
            refine=config.refine, refine_bins=config.refine_bins, mass_rtol=config.mass_rtol, device=device,
        )

    def _histogram(self, device: torch.device | None) -> DistributedHistogram:
        if self._hist is None:
            # an idle rank (no tokens, no device given) uses the collective backend's device
            dev = self._device or device or collective_device()
            self._hist = DistributedHistogram(**self._hist_args, device=dev)
        return self._hist

    def add(self, logratio_fp8: torch.Tensor, logratio_bf16: torch.Tensor,
            advantages: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one mini-batch (same-shape tensors; `mask` bool; `logratio_bf16` = shadow log r)."""
        if self._done:
            raise RuntimeError("this accumulator was already computed; start a new one")
        _check_inputs(logratio_fp8, logratio_bf16, advantages, mask)
        if self.recorded is not None:
            self.recorded.append({name: t.detach().reshape(-1).cpu().clone() for name, t in (
                ("logratio_fp8", logratio_fp8), ("logratio_shadow", logratio_bf16),
                ("advantages", advantages), ("mask", mask))})
        spec = self.spec
        hist = self._histogram(logratio_fp8.device)
        dev = hist.device
        valid = mask.detach().reshape(-1).to(dev)
        # select valid tokens first and go to float64 only for N and P (5e6 tokens: ~0.5 s)
        lr8, lr16, adv = (t.detach().reshape(-1).to(dev)[valid] for t in (logratio_fp8, logratio_bf16, advantages))
        finite_r = torch.isfinite(lr8) & torch.isfinite(lr16)
        finite_a = torch.isfinite(adv)
        good = finite_r & finite_a
        neg, pos = good & (adv < 0), good & (adv > 0)
        x8n, x16n, x8p, x16p = (t.to(torch.float64) for t in (lr8[neg], lr16[neg], lr8[pos], lr16[pos]))
        an, ap = -adv[neg].to(torch.float64), adv[pos].to(torch.float64)
        if spec.mass == "abs_adv_ratio":
            hist.add(x8n, {"neg_count": None, "neg_mass": an * torch.exp(x8n)})
            hist.add(x8p, {"pos_count": None, "pos_mass": ap * torch.exp(x8p)})
            m16n, m16p = an * torch.exp(x16n), ap * torch.exp(x16p)
        else:
            hist.add(x8n, {"neg_count": None})
            hist.add(x8p, {"pos_count": None})
            m16n, m16p = torch.ones_like(x16n), torch.ones_like(x16p)
        clip16n, clip8n = x16n <= spec.t_low, x8n <= spec.t_low
        dual16n, dual8n = x16n > spec.t_dual, x8n > spec.t_dual  # no gradient under dual-clip
        m8n = an * torch.exp(x8n) if spec.mass == "abs_adv_ratio" else torch.ones_like(x8n)
        sums = {
            "n_valid": valid.sum(),
            "n_nonfinite_ratio": (~finite_r).sum(),
            "n_nonfinite_adv": (finite_r & ~finite_a).sum(),
            "n_neg": neg.sum(),
            "n_pos": pos.sum(),
            "k_shadow": clip16n.sum(),
            "n_neg_fp8_eps": clip8n.sum(),
            "n_phantom_eps": (clip8n & ~clip16n).sum(),
            "n_pos_shadow_eps": (x16p > spec.t_high).sum(),
            "n_pos_fp8_eps": (x8p > spec.t_high).sum(),
            "u_plus_shadow": m16p[x16p <= spec.t_high].sum(),
            "u_plus_shadow_all": m16p.sum(),
            "u_minus_shadow": m16n[~clip16n & ~dual16n].sum(),
            "u_minus_fp8_eps": m8n[~clip8n & ~dual8n].sum(),
            "u_minus_fp8_dual": m8n[dual8n].sum(),
        }
        for name, value in sums.items():
            hist.add_scalar(name, value.to(torch.float64))

    def compute(self, group: dist.ProcessGroup | None = None,
                pool: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), *,
                keep_merged: bool = False) -> CalibrationResult:
        """Merge over `group` (one all-reduce; refinement adds one, rarely two) and compute.

        `pool`: merged sums of earlier calibrations (`merged_sums`, oldest first) to solve on
        together with this one; a pooled solve is one-pass (no refinement, see
        CalibrationConfig.pool_calibrations). A step without A < 0 tokens is not pooled (it
        falls back on its own). `keep_merged`: copy this step's own sums to `merged_sums` (only
        a pooling clipper needs them; the copy is the whole histogram).
        """
        if self._done:
            raise RuntimeError("compute() was already called on this accumulator")
        self._done = True
        hist = self._histogram(None)
        nbytes = all_reduce_histograms([hist], group)
        if keep_merged:
            self.merged_sums = hist.merged_sums()
        if hist.scalar("n_neg") == 0:
            pool = ()  # no A < 0 token of its own: re-solving the old steps would count them twice
        spec = self.spec
        for data, scalars in pool:
            hist.add_merged(data, scalars)
        if pool:
            spec = dataclasses.replace(spec, refine=False)
        result = solve(spec, hist, group, nbytes, 1 if distributed_active() else 0)
        return dataclasses.replace(result, pooled_calibrations=1 + len(pool))


def compute_calibrated_bounds(
    logratio_fp8: torch.Tensor,
    logratio_bf16: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    group: dist.ProcessGroup | None = None,
    mass: str = _DEFAULTS.mass,
    shadow_precision: str = _DEFAULTS.shadow_precision,
    upper_rule: str = _DEFAULTS.upper_rule,
    min_clipped_tokens: int = _DEFAULTS.min_clipped_tokens,
    widen_only: bool = _DEFAULTS.widen_only,
    dual_clip_c: float | None = None,
    lower_min: float = _DEFAULTS.lower_min,
    lower_max: float = _DEFAULTS.lower_max,
    upper_min: float = _DEFAULTS.upper_min,
    upper_max: float = _DEFAULTS.upper_max,
    log_ratio_min: float = _DEFAULTS.log_ratio_min,
    log_ratio_max: float = _DEFAULTS.log_ratio_max,
    bins: int = _DEFAULTS.bins,
    refine: bool = _DEFAULTS.refine,
    refine_bins: int = _DEFAULTS.refine_bins,
    mass_rtol: float = _DEFAULTS.mass_rtol,
) -> CalibrationResult:
    """Calibrated [L, H] from one batch of tokens, pooled over `group` (a collective).

    Pure apart from the all-reduce(s): no state, inputs untouched. `logratio_bf16` is the
    shadow's log-ratio whatever `shadow_precision` says. The defaults (CalibrationConfig's)
    never return an infinite or out-of-range bound: such a result is a fallback with a reason.
    """
    acc = CalibrationAccumulator(
        eps_low, eps_high, mass=mass, shadow_precision=shadow_precision, upper_rule=upper_rule,
        min_clipped_tokens=min_clipped_tokens, widen_only=widen_only, dual_clip_c=dual_clip_c,
        lower_min=lower_min, lower_max=lower_max, upper_min=upper_min, upper_max=upper_max,
        log_ratio_min=log_ratio_min, log_ratio_max=log_ratio_max, bins=bins, refine=refine,
        refine_bins=refine_bins, mass_rtol=mass_rtol, device=logratio_fp8.device,
    )
    acc.add(logratio_fp8, logratio_bf16, advantages, mask)
    return acc.compute(group)


def _check_inputs(lr8: torch.Tensor, lr16: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> None:
    for name, t in (("logratio_fp8", lr8), ("logratio_bf16", lr16), ("advantages", adv)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a bool tensor")
    shapes = {tuple(t.shape) for t in (lr8, lr16, adv, mask)}
    if len(shapes) != 1:
        raise ValueError(f"logratio_fp8, logratio_bf16, advantages and mask must have one shape, got {shapes}")
