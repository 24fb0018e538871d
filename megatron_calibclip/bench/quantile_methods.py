"""The two methods `calibclip bench quantile` compares, on the same synthetic tokens: the
trainer's estimator (histograms all-reduced over ranks) and the obvious exact baseline
(all-gather every token, sort). The baseline is the benchmark's independent reference: it shares
no code with megatron_calibclip.calibration, only its definitions of L* and H*."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

EPS_LOW, EPS_HIGH = 0.2, 0.28  # DAPO's clip-higher epsilons
MIN_TOKENS = 1000
# Named estimator settings (overrides of CalibrationConfig's defaults). The targets are judged
# on "default"; the others are the alternatives weighed when the default was chosen (README.md).
# The benchmark measures the estimator against exact sorting on the SPEC's rule (mass_balance,
# the one whose H needs a mass threshold on the merged histogram), without the robustness
# guards (min counts, widen-only), which have their own tests and study (docs/calibration.md).
SPEC_RULE: dict[str, Any] = {"upper_rule": "mass_balance", "min_clipped_tokens": 1, "widen_only": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {**SPEC_RULE},
    "one_pass_16k": {**SPEC_RULE, "bins": 16384, "refine": False},  # the previous default: error up to one bin = 4.9e-4
    "one_pass_128k": {**SPEC_RULE, "bins": 131072, "refine": False},  # finer grid: error up to 6.1e-5, 8x bytes
}


def make_tokens(n: int, rank: int, seed: int):
    """Synthetic per-rank tokens (float32, like the trainer's log-ratios): policy drift 0.12,
    shadow (BF16) noise 0.03 and FP8 noise 0.25 in log r, N(0, 1) advantages, 10% masked."""
    import torch

    from megatron_calibclip.parallel.devices import HOST  # a CPU benchmark (gloo)

    g = torch.Generator(device=HOST).manual_seed((seed * 1_000_003 + rank) * 1_000_033 + n)
    true = torch.randn(n, generator=g, device=HOST) * 0.12
    lr16 = true + torch.randn(n, generator=g, device=HOST) * 0.03
    lr8 = true + torch.randn(n, generator=g, device=HOST) * 0.25
    adv = torch.randn(n, generator=g, device=HOST)
    mask = torch.rand(n, generator=g, device=HOST) > 0.1
    return lr8, lr16, adv, mask


def estimator(config, lr8, lr16, adv, mask):
    """What the trainer does on a calibration step: accumulate, then one collective compute()."""
    from megatron_calibclip.calibration import CalibrationAccumulator

    acc = CalibrationAccumulator.from_config(config, EPS_LOW, EPS_HIGH, device=lr8.device)
    acc.add(lr8, lr16, adv, mask)
    return acc.compute()


@dataclasses.dataclass
class Exact:
    """The baseline's answer and what rank 0 needs to judge the estimator."""

    log_lower: float
    log_upper: float
    p: float
    x8n: Any = None  # float64 FP8 log-ratios of N (global)
    mn8: Any = None  # their masses |A| r8
    x8p_sorted: Any = None  # sorted FP8 log-ratios of P
    cum_p: Any = None  # cumulative |A| r8 of P in that order

    def upper_for(self, log_lower: float) -> float:
        """Exact log H for a given log L (e.g. the estimator's)."""
        return _upper(self.x8n, self.mn8, self.x8p_sorted, self.cum_p, self.p, log_lower)


def baseline(lr8, lr16, adv, mask, *, mass_rtol: float = 1e-9) -> Exact:
    """The obvious exact method: all_gather every token (lr8, lr16, adv float32 + mask uint8 =
    13 bytes/token), then on every rank: L* = k-th smallest log r8 of N (torch.kthvalue, the exact
    alpha-quantile), H* = smallest positive log r8 whose sorted cumulative |A| r mass reaches
    p * U-(r8, L*) (torch.sort + cumsum). float64, same definitions as the estimator."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    full = []
    for t in (lr8, lr16, adv, mask.to(torch.uint8)):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        full.append(torch.cat(parts))
    lr8, lr16, adv = (t.to(torch.float64) for t in full[:3])
    valid = full[3].bool() & torch.isfinite(lr8) & torch.isfinite(lr16) & torch.isfinite(adv)
    neg, pos = valid & (adv < 0), valid & (adv > 0)
    t_low, t_high = math.log1p(-EPS_LOW), math.log1p(EPS_HIGH)
    x8n, x16n, x8p, x16p = lr8[neg], lr16[neg], lr8[pos], lr16[pos]
    an, ap = -adv[neg], adv[pos]
    k = int((x16n <= t_low).sum())
    if k == 0 or x8p.numel() == 0:
        raise RuntimeError("synthetic tokens gave no clipped negative or no positive token")
    log_l = float(torch.kthvalue(x8n, k).values)
    p = float((ap * torch.exp(x16p))[x16p <= t_high].sum() / (an * torch.exp(x16n))[x16n > t_low].sum())
    mn8 = an * torch.exp(x8n)
    x8p_sorted, order = torch.sort(x8p)
    cum_p = torch.cumsum((ap * torch.exp(x8p))[order], 0)
    ex = Exact(log_l, math.nan, p, x8n, mn8, x8p_sorted, cum_p)
    ex.log_upper = _upper(x8n, mn8, x8p_sorted, cum_p, p, log_l, mass_rtol)
    return ex


def _upper(x8n, mn8, x8p_sorted, cum_p, p: float, log_lower: float, mass_rtol: float = 1e-9) -> float:
    import torch

    target = p * float(mn8[x8n > log_lower].sum())
    need = target - mass_rtol * float(cum_p[-1])
    if need <= 0:
        return -math.inf
    idx = int(torch.searchsorted(cum_p, torch.tensor([need], dtype=torch.float64,
                                                     device=cum_p.device)))
    return float(x8p_sorted[idx]) if idx < cum_p.numel() else math.inf
