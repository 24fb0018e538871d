"""Property tests of compute_calibrated_bounds against the exact numpy reference.

Distributions: heavy-tailed, tied (float64, ties exactly at log(1 - eps)), single-bin,
single-token, out-of-range, realistic; masked NaN/inf everywhere; optional unmasked NaN/inf.
Locally (no process group) with many examples, and on 2 gloo ranks with cases batched.
"""
import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_calibclip.calibration import compute_calibrated_bounds
from tests.calibration.checks import SPEC_EXACT, assert_matches_exact
from tests.calibration.data import KINDS, make_batch
from tests.calibration.distutil import group_of

EPS = [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)]


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.integers(1, 3)) if kind == "single_token" else draw(st.integers(1, 300))
    batch = make_batch(kind, n, draw(st.integers(0, 2 ** 31)))
    if draw(st.booleans()) and draw(st.integers(0, 3)) == 0 and batch["mask"].any():
        i = int(np.flatnonzero(batch["mask"])[0])  # unmasked non-finite value
        key = draw(st.sampled_from(["lr8", "lr16", "adv"]))
        batch[key][i] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    eps_low, eps_high = draw(st.sampled_from(EPS))
    mass = draw(st.sampled_from(["abs_adv_ratio", "tokens"]))
    return batch, eps_low, eps_high, mass


def _tensors(batch):
    return [torch.from_numpy(np.ascontiguousarray(batch[k])) for k in ("lr8", "lr16", "adv", "mask")]


@settings(max_examples=120, deadline=None)
@given(case=cases())
def test_local_bounds_match_exact(case):
    batch, eps_low, eps_high, mass = case
    for refine in (False, True):
        res = compute_calibrated_bounds(*_tensors(batch), eps_low, eps_high, mass=mass, refine=refine, **SPEC_EXACT)
        assert res.num_collectives == 0 and res.bytes_communicated == 0
        assert_matches_exact(res, batch, eps_low, eps_high, mass, refined=refine)


def _rank_cases(rank, world_size, case_list):
    """Each case: (batch, owner array, eps_low, eps_high, mass), run on groups of 2 ranks."""
    group, index = group_of(2)
    out = []
    for batch, owner, eps_low, eps_high, mass in case_list:
        sel = owner == index
        tensors = [torch.from_numpy(np.ascontiguousarray(batch[k][sel])) for k in ("lr8", "lr16", "adv", "mask")]
        out.append([dict(compute_calibrated_bounds(*tensors, eps_low, eps_high, group=group, mass=mass,
                                                   refine=r, **SPEC_EXACT).__dict__) for r in (False, True)])
    return out


@settings(max_examples=8, deadline=None)
@given(case_list=st.lists(st.tuples(cases(), st.integers(0, 2 ** 31)), min_size=6, max_size=6))
def test_two_ranks_bounds_match_exact(dist_pool, case_list):
    jobs = []
    for (batch, eps_low, eps_high, mass), seed in case_list:
        n = len(batch["mask"])
        owner = np.random.default_rng(seed).integers(0, 2, n)  # arbitrary split, may leave a rank empty
        jobs.append((batch, owner, eps_low, eps_high, mass))
    per_rank = dist_pool(4).run(_rank_cases, jobs)  # two independent groups of 2 ranks
    for i, (batch, _, eps_low, eps_high, mass) in enumerate(jobs):
        assert all(per_rank[r][i] == per_rank[0][i] for r in range(4))  # every rank, same answer
        for refined, res in zip((False, True), per_rank[0][i]):
            assert_matches_exact(res, batch, eps_low, eps_high, mass, refined=refined)
