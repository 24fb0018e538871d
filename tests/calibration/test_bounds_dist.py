"""compute_calibrated_bounds over gloo process groups of 1, 2 and 4 ranks: accuracy vs exact
sorting, DP invariance, collective count, mini-batch accumulation, non-finite values."""
import functools
import math

import numpy as np
import pytest
import torch

from megatron_calibclip.calibration import CalibrationAccumulator, compute_calibrated_bounds
from megatron_calibclip.calibration.solver import SCALARS
from tests.calibration.checks import SPEC_EXACT, assert_matches_exact
from tests.calibration.data import make_batch
from tests.calibration.distutil import count_collectives, group_of

KEYS = ("lr8", "lr16", "adv", "mask")
pytestmark = pytest.mark.dist


def _local(batch, owner, index):
    sel = owner == index
    return [torch.from_numpy(np.ascontiguousarray(batch[k][sel])) for k in KEYS]


def _rank_jobs(rank, world_size, jobs):
    """jobs: (group size, batch, owner, eps_low, eps_high, mass, refine) -> (result dict, collectives)."""
    out = []
    for size, batch, owner, eps_low, eps_high, mass, refine in jobs:
        group, index = group_of(size)
        tensors = _local(batch, owner, index)
        res, calls = count_collectives(functools.partial(
            compute_calibrated_bounds, *tensors, eps_low, eps_high, group=group, mass=mass, refine=refine,
            **SPEC_EXACT))
        out.append((dict(res.__dict__), calls))
    return out


def _owner(n, size, how, seed=0):
    if how == "contiguous":
        return np.minimum(np.arange(n) * size // n, size - 1)
    if how == "last_rank_empty":  # the last member gets no token at all
        return np.minimum(np.arange(n) * max(size - 1, 1) // n, max(size - 2, 0))
    return np.random.default_rng(seed).integers(0, size, n)  # "random" interleaving


def _same_on_all_ranks(per_rank, j):
    first = per_rank[0][j][0]
    assert all(per_rank[r][j][0] == first for r in range(len(per_rank)))
    return per_rank[0][j]


def test_accuracy_against_exact_sorting_on_1_2_4_ranks(dist_pool):
    batches = [("realistic", make_batch("realistic", 20_000, 1)), ("heavy", make_batch("heavy", 20_000, 2)),
               ("out_of_range", make_batch("out_of_range", 5_000, 3))]
    jobs = [(size, b, _owner(len(b["mask"]), size, "random", 7), 0.2, 0.28, mass, refine)
            for size in (1, 2, 4) for kind, b in batches
            for mass in ("abs_adv_ratio", "tokens") for refine in (False, True)]
    kinds = [kind for size in (1, 2, 4) for kind, _ in batches for _m in range(2) for _r in range(2)]
    per_rank = dist_pool(4).run(_rank_jobs, jobs)
    for j, (_size, batch, _, eps_low, eps_high, mass, refine) in enumerate(jobs):
        res, calls = _same_on_all_ranks(per_rank, j)
        assert res["reason"] is None or kinds[j] == "out_of_range"  # H* past the grid: a fallback
        # one pass: within one bin of exact; refined: <= 1e-6 (see checks.assert_matches_exact);
        # on continuous data the refined H* is also that close to H for the *exact* L*
        assert_matches_exact(res, batch, eps_low, eps_high, mass, refined=refine,
                             unconditional=refine and kinds[j] == "realistic")
        # one SUM all-reduce of O(bins) numbers; refinement adds one (two if H's bin was unknown)
        assert {name for name, _ in calls} == {"all_reduce"}
        assert len(calls) == res["num_collectives"]
        assert 2 <= len(calls) <= 3 if refine else len(calls) == 1
        assert sum(b for _, b in calls) == res["bytes_communicated"]
        channels = 4 if mass == "abs_adv_ratio" else 2
        assert calls[0][1] == (channels * (16384 + 2) + len(SCALARS)) * 8  # the same for 5k and 20k tokens


def test_dp_invariance_identical_bounds_for_any_split(dist_pool):
    batch = make_batch("heavy", 12_000, 11)
    n = len(batch["mask"])
    jobs = []
    for size in (1, 2, 4):
        owners = [_owner(n, size, how, seed=size) for how in ("contiguous", "random", "last_rank_empty")]
        if size > 1:  # member 0 holds only masked tokens
            owner = _owner(n, size, "random", seed=3)
            owner[batch["mask"] & (owner == 0)] = 1
            owners.append(owner)
        jobs += [(size, batch, owner, 0.2, 0.28, "abs_adv_ratio", refine)
                 for owner in owners for refine in (False, True)]
    per_rank = dist_pool(4).run(_rank_jobs, jobs)
    seen = {False: set(), True: set()}
    for j, job in enumerate(jobs):
        res, _ = _same_on_all_ranks(per_rank, j)
        assert res["reason"] is None
        seen[job[-1]].add((res["log_lower"], res["log_upper"], res["alpha"], res["n_neg"], res["n_pos"],
                           res["n_neg_clipped_shadow"], res["neg_clip_frac_fp8_lower"], res["pos_clip_frac_fp8_upper"]))
    # bitwise identical bounds for 1, 2, 4 ranks and every split, one-pass and refined
    assert len(seen[False]) == 1 and len(seen[True]) == 1, seen
    assert seen[False] != seen[True]


def _rank_accumulate(rank, world_size, minibatches, owners):
    """Three mini-batches accumulated into one calibration vs their concatenation in one call."""
    group, index = group_of(2)
    acc = CalibrationAccumulator(0.2, 0.28, refine=True, **SPEC_EXACT)
    for batch, owner in zip(minibatches, owners):
        acc.add(*_local(batch, owner, index))
    res_acc, calls = count_collectives(lambda: acc.compute(group))
    cat = {k: np.concatenate([b[k] for b in minibatches]) for k in KEYS}
    res_one = compute_calibrated_bounds(*_local(cat, np.concatenate(owners), index), 0.2, 0.28, group=group,
                                        refine=True, **SPEC_EXACT)
    return dict(res_acc.__dict__), dict(res_one.__dict__), calls


def _rank_nonfinite(rank, world_size, batch, owner, poisoned):
    """Masked garbage vs masked zeros; then an unmasked NaN on member `poisoned` only."""
    group, index = group_of(4)
    clean = {k: v.copy() for k, v in batch.items()}
    for k in ("lr8", "lr16", "adv"):
        clean[k][~clean["mask"]] = 0.123  # masked values changed: must not matter
    res = [compute_calibrated_bounds(*_local(b, owner, index), 0.2, 0.28, group=group, **SPEC_EXACT)
           for b in (batch, clean)]
    bad = {k: v.copy() for k, v in batch.items()}
    if index == poisoned:
        bad["lr16"][int(np.flatnonzero(bad["mask"] & (owner == index))[0])] = np.nan
    res.append(compute_calibrated_bounds(*_local(bad, owner, index), 0.2, 0.28, group=group, refine=True,
                                         **SPEC_EXACT))
    return [dict(r.__dict__) for r in res]


def test_minibatches_accumulate_and_nonfinite_values(dist_pool):
    pool = dist_pool(4)
    mbs = [make_batch("realistic", n, 20 + i) for i, n in enumerate((3000, 1, 5000))]
    owners = [_owner(len(b["mask"]), 2, "random", i) for i, b in enumerate(mbs)]
    results = pool.run(_rank_accumulate, mbs, owners)
    for res_acc, res_one, calls in results:
        assert res_acc == res_one and res_acc["reason"] is None
        assert [name for name, _ in calls][0] == "all_reduce" and len(calls) == res_acc["num_collectives"]
        assert res_acc == results[0][0]

    batch = make_batch("realistic", 4000, 5)
    owner = _owner(4000, 4, "random", 1)
    for garbage, clean, poisoned in pool.run(_rank_nonfinite, batch, owner, 2):
        assert garbage["reason"] is None and garbage == clean  # masked NaN/inf are ignored
        # an unmasked NaN on one rank only: every rank falls back with the reason, no hang
        assert poisoned["reason"].startswith("nonfinite_ratio: 1 unmasked")
        assert poisoned["lower"] is None and poisoned["num_collectives"] == 1
        assert math.isfinite(poisoned["alpha"])  # diagnostics of the finite tokens still reported


def _bin_straddling_batch(neighbour_weight):
    """The k-th negative token shares its bin with two neighbours; the bin's mass (unknown after one
    pass) moves the H target across several positive bins: refinement zooms into all of them
    (light neighbours, a few bins) or needs a third all-reduce (heavy ones, too many bins)."""
    n_lr8 = np.concatenate([[-0.5, -0.5 + 1e-5, -0.5 + 2e-5], np.linspace(0.0, 0.5, 20)])
    n_lr16 = np.concatenate([[-0.5], np.zeros(22)])
    n_adv = -np.concatenate([np.full(3, neighbour_weight), np.ones(20)])
    p_lr8 = np.linspace(-0.3, 1.0, 2000)
    lr8 = np.concatenate([n_lr8, p_lr8])
    lr16 = np.concatenate([n_lr16, np.zeros(2000)])
    adv = np.concatenate([n_adv, np.ones(2000)])
    return {"lr8": lr8, "lr16": lr16, "adv": adv, "mask": np.ones(len(lr8), dtype=bool)}


def test_refinement_zooms_all_candidate_upper_bins_or_takes_a_third_pass(dist_pool):
    batches = [_bin_straddling_batch(0.05), _bin_straddling_batch(1.0)]
    jobs = [(2, b, _owner(len(b["mask"]), 2, "random", 5), 0.2, 0.28, "abs_adv_ratio", refine)
            for b in batches for refine in (False, True)]
    per_rank = dist_pool(4).run(_rank_jobs, jobs)
    for j, (_, batch, _, _, _, _, refine) in enumerate(jobs):
        res, calls = _same_on_all_ranks(per_rank, j)
        assert_matches_exact(res, batch, 0.2, 0.28, "abs_adv_ratio", refined=refine, unconditional=refine)
        heavy = j >= 2
        assert len(calls) == res["num_collectives"] == (1 if not refine else 3 if heavy else 2)
        if refine and not heavy:  # pass 2 = N zoom of 1 slot + P zoom of m >= 2 slots, 2 channels each
            m = (calls[1][1] // 8 - 2 * (4096 + 2) - 4) / (2 * 4096)
            assert m == int(m) and 2 <= m <= 8, m
