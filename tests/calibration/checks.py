"""Assertions comparing a CalibrationResult with the exact numpy reference (tests only)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from megatron_calibclip.calibration import CalibrationResult
from tests.calibration.reference import exact_lower, exact_upper, snapped_ok

LO, HI, BINS, REFINE_BINS = -4.0, 4.0, 16384, 4096
WIDTH = (HI - LO) / BINS
# The SPEC's rule with no range, no widening and the weakest count guard: what these exactness
# checks of the estimator machinery compare (the guards and rules have tests of their own)
SPEC_EXACT = {"upper_rule": "mass_balance", "min_clipped_tokens": 1, "widen_only": False,
              "lower_min": 0.0, "lower_max": math.inf, "upper_min": 0.0, "upper_max": math.inf}


def assert_matches_exact(res, batch, eps_low, eps_high, mass, *, refined: bool, unconditional: bool = False):
    """res: CalibrationResult (or its dict of fields) for the *global* batch.

    Checks: same fallback reason; same counts and alpha; log L* is the exact k-th order
    statistic rounded up to the grid (so within one bin width, or <= 1e-6 refined); log H* is
    the exact H for the returned L* rounded up to the grid. With `unconditional`, H* must also
    be that close to the exact H for the exact L* (true unless another FP8 ratio lies between
    the exact and the returned L*; use it only on continuous data with refinement).
    """
    r = res if isinstance(res, dict) else res.__dict__
    ex = exact_lower(batch["lr8"], batch["lr16"], batch["adv"], batch["mask"], eps_low, eps_high, mass)
    code = None if r["reason"] is None else r["reason"].split(":", 1)[0]
    resolution = WIDTH / REFINE_BINS if refined else WIDTH
    expected = ex.reason
    if expected is None and ex.log_lower > HI:  # L* past the grid: +inf, not a usable bound
        expected = "lower_out_of_range"
    if expected is None:
        assert r["log_lower_raw"] is not None and snapped_ok(r["log_lower_raw"], ex.log_lower, LO, HI, resolution)
        h_exact = exact_upper(batch["lr8"], batch["lr16"], batch["adv"], batch["mask"], eps_low, eps_high,
                              r["log_lower_raw"], mass)
        if h_exact == math.inf:  # p * U-(r8, L) exceeds the whole positive mass
            expected = "upper_infeasible"
        elif h_exact > HI:
            expected = "upper_out_of_range"
        elif code == "upper_from_few_tokens":  # H* at or above every positive FP8 ratio
            lr8, adv, m = (np.asarray(batch[k]) for k in ("lr8", "adv", "mask"))
            with np.errstate(invalid="ignore"):
                pos = m & np.isfinite(lr8) & np.isfinite(np.asarray(batch["lr16"])) & np.isfinite(adv) & (adv > 0)
            assert snapped_ok(r["log_upper_raw"], h_exact, LO, HI, resolution)
            assert not (lr8[pos].astype(np.float64) > r["log_upper_raw"]).any()
            expected = code
    assert code == expected, (r["reason"], expected)
    if expected is not None:
        assert r["lower"] is None and r["upper"] is None
        return
    assert r["resolution"] == resolution
    assert (r["n_neg"], r["n_pos"], r["n_neg_clipped_shadow"]) == (ex.n_neg, ex.n_pos, ex.k)
    assert r["alpha"] == ex.alpha
    assert math.isclose(r["p_bf16"], ex.p, rel_tol=1e-9)
    log_l, log_h = r["log_lower"], r["log_upper"]
    assert snapped_ok(log_l, ex.log_lower, LO, HI, resolution), (log_l, ex.log_lower)
    h_exact = exact_upper(batch["lr8"], batch["lr16"], batch["adv"], batch["mask"], eps_low, eps_high, log_l, mass)
    assert snapped_ok(log_h, h_exact, LO, HI, resolution), (log_h, h_exact)
    bound = 1e-6 if refined else WIDTH  # the required precision
    if LO < ex.log_lower <= HI:
        assert abs(log_l - ex.log_lower) <= bound
    if LO < h_exact <= HI:
        assert abs(log_h - h_exact) <= bound
    if unconditional:
        h_star = exact_upper(batch["lr8"], batch["lr16"], batch["adv"], batch["mask"], eps_low, eps_high,
                             ex.log_lower, mass)
        assert snapped_ok(log_h, h_star, LO, HI, resolution), (log_h, h_star)
    assert r["lower"] == math.exp(log_l) and r["upper"] == math.exp(log_h)
    # exact diagnostics at the returned bounds
    lr8 = np.asarray(batch["lr8"], dtype=np.float64)
    adv = np.asarray(batch["adv"], dtype=np.float64)
    valid = np.asarray(batch["mask"]) & np.isfinite(lr8) & np.isfinite(adv)
    with np.errstate(invalid="ignore"):
        neg, pos = valid & (adv < 0), valid & (adv > 0)
    assert r["neg_clip_frac_fp8_lower"] == (lr8[neg] <= log_l).sum() / ex.n_neg
    assert math.isclose(r["pos_clip_frac_fp8_upper"], (lr8[pos] > log_h).sum() / ex.n_pos, abs_tol=1e-12)


def fake_result(lower, upper, reason=None) -> CalibrationResult:
    """A CalibrationResult with given raw bounds (other fields are irrelevant to the clipper)."""
    values = {f.name: 0 for f in dataclasses.fields(CalibrationResult)}
    values.update(lower=lower, upper=upper, reason=reason, mass="abs_adv_ratio", shadow_precision="bf16",
                  refined=False, resolution=2.0 ** -11, alpha=0.1, p_bf16=1.0)
    values.update(log_lower=None if lower is None else math.log(lower),
                  log_upper=None if upper is None else math.log(upper))
    return CalibrationResult(**values)
