"""Exact calibrated bounds on gathered data with numpy sorting: the reference for the tests.

Written from the SPEC / README definitions only; it shares no code with the histogram.
All comparisons are in log space, float64, against log1p(-eps_low) and log1p(eps_high).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Exact:
    reason: str | None  # reason code, or None
    n_neg: int
    n_pos: int
    k: int
    alpha: float | None
    p: float | None
    log_lower: float | None  # k-th smallest FP8 log-ratio over N


def _split(lr8, lr16, adv, mask):
    lr8, lr16, adv = (np.asarray(a, dtype=np.float64).ravel() for a in (lr8, lr16, adv))
    mask = np.asarray(mask, dtype=bool).ravel()
    with np.errstate(invalid="ignore"):
        bad_ratio = mask & ~(np.isfinite(lr8) & np.isfinite(lr16))
        bad_adv = mask & ~bad_ratio & ~np.isfinite(adv)
        good = mask & ~bad_ratio & ~bad_adv
        neg, pos = good & (adv < 0), good & (adv > 0)
    return lr8, lr16, adv, neg, pos, int(bad_ratio.sum()), int(bad_adv.sum())


def _mass(adv, lr, mass):
    return np.abs(adv) * np.exp(lr) if mass == "abs_adv_ratio" else np.ones_like(lr)


def exact_lower(lr8, lr16, adv, mask, eps_low, eps_high, mass="abs_adv_ratio") -> Exact:
    """Guards, alpha, p and the exact L* (k-th order statistic of log r8 over N)."""
    lr8, lr16, adv, neg, pos, bad_r, bad_a = _split(lr8, lr16, adv, mask)
    t_low, t_high = math.log1p(-eps_low), math.log1p(eps_high)
    n_neg, n_pos = int(neg.sum()), int(pos.sum())
    k = int((lr16[neg] <= t_low).sum())
    alpha = k / n_neg if n_neg else None
    u_plus = float(_mass(adv[pos], lr16[pos], mass)[lr16[pos] <= t_high].sum())
    u_minus = float(_mass(adv[neg], lr16[neg], mass)[lr16[neg] > t_low].sum())
    p = u_plus / u_minus if u_minus > 0 else None
    reason = None
    if bad_r:
        reason = "nonfinite_ratio"
    elif bad_a:
        reason = "nonfinite_advantage"
    elif n_neg == 0:
        reason = "no_negative_tokens"
    elif k == 0:
        reason = "alpha_zero"
    elif n_pos == 0:
        reason = "no_positive_tokens"
    elif u_minus <= 0:
        reason = "alpha_one"
    log_lower = float(np.sort(lr8[neg])[k - 1]) if reason is None else None
    return Exact(reason, n_neg, n_pos, k, alpha, p, log_lower)


def smallest_reaching(values, weights, target, rtol=1e-9) -> float:
    """min{x : sum(weights[values <= x]) >= target - rtol * total}; -inf / +inf at the ends."""
    order = np.argsort(values, kind="stable")
    v, cum = values[order], np.cumsum(weights[order])
    total = float(cum[-1]) if len(cum) else 0.0
    need = target - rtol * total
    if need <= 0:
        return -math.inf
    idx = int(np.searchsorted(cum, need, side="left"))
    return float(v[idx]) if idx < len(v) else math.inf


def exact_upper(lr8, lr16, adv, mask, eps_low, eps_high, log_lower, mass="abs_adv_ratio", rtol=1e-9) -> float:
    """Exact H* (log) for the lower bound `log_lower`: smallest h with U+(r8,h) >= p U-(r8,L)."""
    lr8, lr16, adv, neg, pos, _, _ = _split(lr8, lr16, adv, mask)
    p = exact_lower(lr8, lr16, adv, mask, eps_low, eps_high, mass).p
    m_neg = _mass(adv[neg], lr8[neg], mass)
    target = p * float(m_neg[lr8[neg] > log_lower].sum())
    return smallest_reaching(lr8[pos], _mass(adv[pos], lr8[pos], mass), target, rtol)


def snapped_ok(est: float, exact: float, lo: float, hi: float, resolution: float) -> bool:
    """Is `est` the exact value rounded up to a grid of spacing <= resolution on [lo, hi]?

    Below the range the grid answer is lo, above it +inf; inside, 0 <= est - exact <= resolution.
    """
    if exact <= lo:
        return est == lo
    if exact > hi:
        return est == math.inf
    return 0.0 <= est - exact <= resolution * (1 + 1e-9) + 1e-15


def interpolated_ok(est: float, exact: float, lo: float, hi: float, width: float) -> bool:
    """Interpolated estimate: within one bin of the exact value clipped to [lo, hi]."""
    return abs(est - min(max(exact, lo), hi)) <= width * (1 + 1e-9) + 1e-15


@dataclass
class ExactBounds:
    reason: str | None  # fallback code, or None
    log_lower: float | None  # L used (after widen-only)
    log_upper: float | None  # H used (after widen-only)
    log_lower_raw: float | None  # L*
    log_upper_raw: float | None  # H*


def exact_bounds(lr8, lr16, adv, mask, eps_low, eps_high, *, rule, min_clipped=20, widen_only=True,
                 dual_c=None, mass="abs_adv_ratio", lower_range=(0.05, 0.999), upper_range=(1.001, 20.0),
                 rtol=1e-9) -> ExactBounds:
    """Every upper rule and guard of docs/calibration.md by sorting, in float64 log space.

    Order of checks, as documented: input guards; L* and its range (widen-only: L = min(L*,
    1 - eps_low)); H* by the rule (mass_balance: infeasible target); H* finite and <= the range
    top; >= min_clipped positive tokens above H* (tail rules); widen-only H = max(H*, 1 + eps_high).
    """
    lr8, lr16, adv, neg, pos, bad_r, bad_a = _split(lr8, lr16, adv, mask)
    t_low, t_high = math.log1p(-eps_low), math.log1p(eps_high)
    t_dual = math.inf if dual_c is None else math.log(dual_c)
    x8n, x16n, x8p, x16p = lr8[neg], lr16[neg], lr8[pos], lr16[pos]
    m8n, m16n = _mass(adv[neg], x8n, mass), _mass(adv[neg], x16n, mass)
    m8p, m16p = _mass(adv[pos], x8p, mass), _mass(adv[pos], x16p, mass)
    k, k_pos = int((x16n <= t_low).sum()), int((x16p > t_high).sum())
    tail = rule in ("quantile", "mass_fraction", "mass_balance")
    u_minus16 = float(m16n[(x16n > t_low) & (x16n <= t_dual)].sum())
    fail = lambda code, l_raw=None, h_raw=None: ExactBounds(code, None, None, l_raw, h_raw)  # noqa: E731
    for code, bad in (("nonfinite_ratio", bad_r), ("nonfinite_advantage", bad_a), ("no_negative_tokens", not neg.any()),
                      ("alpha_zero", k == 0), ("too_few_clipped_negative", k < min_clipped),
                      ("no_positive_tokens", tail and not pos.any()),
                      ("alpha_one", rule == "mass_balance" and u_minus16 <= 0),
                      ("too_few_clipped_positive", rule == "quantile" and k_pos < min_clipped)):
        if bad:
            return fail(code)
    log = lambda x: -math.inf if x == 0 else math.log(x)  # noqa: E731
    lo_l, hi_l = log(lower_range[0]), log(lower_range[1])
    lo_h, hi_h = log(upper_range[0]), log(upper_range[1])
    l_star = float(np.sort(x8n)[k - 1])
    if not (math.isfinite(l_star) and lo_l <= l_star <= (math.inf if widen_only else hi_l)):
        return fail("lower_out_of_range", l_star)
    log_l = min(l_star, t_low) if widen_only else l_star
    if not lo_l <= log_l <= hi_l:
        return fail("lower_out_of_range", l_star)
    if rule == "host":  # L-only: H is the host's 1 + eps_high
        h_star = t_high
    elif rule == "log_scale":
        h_star = t_high * log_l / t_low
    elif rule == "quantile":
        h_star = float(np.sort(x8p)[len(x8p) - k_pos - 1]) if len(x8p) > k_pos else -math.inf
    elif rule == "mass_fraction":
        share = float(m16p[x16p <= t_high].sum()) / float(m16p.sum())
        h_star = smallest_reaching(x8p, m8p, share * float(m8p.sum()), rtol)
    else:
        p = float(m16p[x16p <= t_high].sum()) / u_minus16
        target = p * float(m8n[(x8n > log_l) & (x8n <= t_dual)].sum())
        if target > float(m8p.sum()) * (1 + rtol):
            return fail("upper_infeasible", l_star)
        h_star = smallest_reaching(x8p, m8p, target, rtol)
    if not (math.isfinite(h_star) and (-math.inf if widen_only else lo_h) <= h_star <= hi_h):
        return fail("upper_out_of_range", l_star, h_star)
    if tail and int((x8p > h_star).sum()) < min_clipped:
        return fail("upper_from_few_tokens", l_star, h_star)
    log_h = max(h_star, t_high) if widen_only else h_star
    if not lo_h <= log_h <= hi_h:
        return fail("upper_out_of_range", l_star, h_star)
    return ExactBounds(None, log_l, log_h, l_star, h_star)
