"""Synthetic calibration batches (numpy), shared by the tests; no library code involved."""
from __future__ import annotations

import math

import numpy as np
import torch

LOG_08 = math.log1p(-0.2)  # exactly the eps_low = 0.2 threshold, float64
KINDS = ("realistic", "heavy", "tied", "single_bin", "single_token", "out_of_range")


def make_batch(kind: str, n: int, seed: int, masked_garbage: bool = True) -> dict[str, np.ndarray]:
    """lr8 (FP8 log-ratio), lr16 (shadow log-ratio), adv, mask; masked slots may hold NaN/inf."""
    rng = np.random.default_rng(seed)
    if kind == "realistic":  # policy drift + small shadow noise + large FP8 noise
        true = rng.normal(0.0, 0.12, n)
        lr16 = true + rng.normal(0.0, 0.03, n)
        lr8 = true + rng.normal(0.0, 0.25, n)
        adv = rng.normal(0.0, 1.0, n)
    elif kind == "heavy":
        true = 0.1 * rng.standard_t(1.5, n)
        lr16 = true + 0.03 * rng.standard_t(2.0, n)
        lr8 = true + 0.2 * rng.standard_t(1.5, n)
        adv = rng.standard_t(2.0, n)
    elif kind == "tied":
        pool = np.array([-0.5, -0.25, LOG_08, 0.0, 0.1, 0.25, 0.5])
        lr16 = rng.choice(pool, n)
        lr8 = rng.choice(pool, n)
        adv = rng.choice([-2.0, -1.0, 0.0, 1.0, 3.0], n)
    elif kind == "single_bin":  # every FP8 ratio inside one 2^-11 bin
        lr8 = -0.30029296875 + rng.uniform(0.05, 0.95, n) * 2.0 ** -11  # inside bin 7578 of [-4, 4]/2^14
        lr16 = rng.normal(-0.2, 0.1, n)
        adv = rng.normal(0.0, 1.0, n)
    elif kind == "single_token":
        lr8 = rng.normal(0.0, 0.3, n)
        lr16 = np.full(n, -0.5)
        adv = np.where(np.arange(n) % 2 == 0, -1.0, 1.0) * rng.uniform(0.5, 2.0, n)
    elif kind == "out_of_range":
        lr16 = rng.normal(-0.1, 0.3, n)
        lr8 = rng.normal(0.0, 1.0, n) * rng.choice([1.0, 8.0, 40.0], n)
        adv = rng.normal(0.0, 1.0, n)
    else:
        raise ValueError(kind)
    mask = rng.random(n) > 0.1 if n > 4 else np.ones(n, dtype=bool)
    dtype = np.float64 if kind == "tied" else np.float32  # float64: ties exactly at log(1 - eps)
    lr8, lr16, adv = lr8.astype(dtype), lr16.astype(dtype), adv.astype(dtype)
    if masked_garbage and (~mask).any():
        idx = np.flatnonzero(~mask)
        lr8[idx[::3]] = np.nan
        lr16[idx[1::3]] = np.inf
        adv[idx[2::3]] = -np.inf
    return {"lr8": lr8, "lr16": lr16, "adv": adv, "mask": mask}


def shard(batch: dict[str, np.ndarray], owner: np.ndarray, rank: int) -> dict[str, np.ndarray]:
    """Tokens of `batch` whose owner (per-token rank id) is `rank`."""
    sel = owner == rank
    return {k: v[sel] for k, v in batch.items()}


KEYS = ("lr8", "lr16", "adv", "mask")


def small_step(seed: int, n: int = 400, shadow_std: float = 0.1, fp8_std: float = 0.2) -> dict[str, np.ndarray]:
    """One small RL step: ~n/2 tokens with A < 0; the shadow clips ~1% of them (1-4 tokens),
    FP8 adds noise of `fp8_std` in log r (the reproduction's regime)."""
    rng = np.random.default_rng(seed)
    lr16 = rng.normal(0.0, shadow_std, n)
    return {"lr8": lr16 + rng.normal(0.0, fp8_std, n), "lr16": lr16,
            "adv": np.where(rng.random(n) < 0.5, -1.0, 1.0) * rng.uniform(0.2, 1.5, n),
            "mask": rng.random(n) > 0.05}


def step_with_clipped(k: int, seed: int, n: int = 200) -> dict[str, np.ndarray]:
    """A step whose shadow clips exactly `k` of its n/2 A < 0 tokens (k = -1: no A < 0 token)."""
    rng = np.random.default_rng(seed)
    adv = np.where(np.arange(n) % 2 == 0, -1.0, 1.0) * rng.uniform(0.2, 1.5, n)
    if k < 0:
        adv = np.abs(adv)
    lr16 = rng.uniform(-0.1, 0.1, n)
    lr16[np.flatnonzero(adv < 0)[:max(k, 0)]] = -0.5  # below log(0.8)
    return {"lr8": lr16 + rng.normal(0.0, 0.2, n), "lr16": lr16, "adv": adv, "mask": np.ones(n, bool)}


def step_tensors(step: dict[str, np.ndarray], sel=None) -> list[torch.Tensor]:
    """The step's (lr8, lr16, adv, mask) as tensors (optionally a subset of its tokens)."""
    sel = np.ones(len(step["mask"]), bool) if sel is None else sel
    return [torch.from_numpy(np.ascontiguousarray(step[k][sel])) for k in KEYS]


def union(steps: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The tokens of several steps as one."""
    return {k: np.concatenate([s[k] for s in steps]) for k in KEYS}
