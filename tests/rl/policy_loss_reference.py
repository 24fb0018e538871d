"""Recorded outputs of the single-function policy_loss (commit 0bffeb9), for bit-identity.

Why: the loss was rewritten as small terms (issue 26); its behaviour must not move by one
bit. This module, run with the code of commit 0bffeb9 (before any change) first on the import
path, wrote `data/policy_loss_0bffeb9_<machine>.pt`: every case's inputs and the old code's
loss, gradients (log-probs, entropy), metrics, counts and extrema, with their key order.
test_policy_loss_recorded.py replays the stored inputs through today's code and asserts
torch.equal. Do not re-record against new code: the file is the old code's answer.

One file per kind of CPU (`machine_key()`: ATen's CPU capability and the CPU vendor): the old
code's own float64 answer differs in the last bits between kinds (measured: 9 of 51 cases, at
most 3.2 units in the last place, on an AVX-512 Intel Xeon against the AVX2 AMD EPYC
recording; 19 cases with the Xeon forced to ATen's AVX2 kernels, so the kernels are not all
ATen's: MKL, which torch's vectorised math may call, picks its code paths by vendor and ISA).
To add a kind of CPU:

    git worktree add /tmp/calibclip-0bffeb9 0bffeb9
    PYTHONPATH=/tmp/calibclip-0bffeb9 python tests/rl/policy_loss_reference.py

The cases are the inputs of the hand-derived tests of tests/rl (test_policy_loss.py,
test_config.py) plus a seeded grid over every option (aggregation mode x correction x
dual-clip x KL type x entropy x shadow x normaliser x dtype x 1-D/2-D x per-sequence
advantages x float/tensor bounds), with NaN/inf under padding.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any, Callable

import torch

DATA = Path(__file__).parent / "data"
RECORDED_AT = "0bffeb9"


def machine_key() -> str:
    """'AVX2-AuthenticAMD', 'AVX512-GenuineIntel', ...: what the last bits depend on."""
    vendor = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                vendor = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{torch.backends.cpu.get_cpu_capability()}-{vendor}"


def fixture_path(machine: str) -> Path:
    return DATA / f"policy_loss_{RECORDED_AT}_{machine}.pt"


def recorded_machines() -> list[str]:
    prefix = f"policy_loss_{RECORDED_AT}_"
    return sorted(p.stem[len(prefix):] for p in DATA.glob(prefix + "*.pt"))
D = torch.float64
TENSOR_KEYS = ("logprobs", "old_logprobs", "advantages", "mask")


def _lp(ratios: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(r) for r in ratios], dtype=D)


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


def _hand_cases() -> list[dict[str, Any]]:
    """The inputs of the hand-derived tests in tests/rl (same numbers, same keywords)."""
    cases = []
    clip = [(0.5, -1.0), (1.0, -1.0), (2.0, -1.0), (1.5, 2.0), (0.5, 2.0), (1.0, 2.0)]
    cases.append(dict(name="hand_clip", logprobs=_lp([c[0] for c in clip]), old_logprobs=torch.zeros(6, dtype=D),
                      advantages=torch.tensor([c[1] for c in clip], dtype=D), mask=_ones(6),
                      clip_low=0.8, clip_high=1.28))
    g = torch.Generator().manual_seed(0)
    cases.append(dict(name="min_formulation_tensor_bounds", logprobs=torch.randn(3, 7, dtype=D, generator=g) * 0.5,
                      old_logprobs=torch.randn(3, 7, dtype=D, generator=g) * 0.5,
                      advantages=torch.randn(3, dtype=D, generator=g), mask=torch.rand(3, 7, generator=g) > 0.2,
                      clip_low=torch.tensor(0.7, dtype=D), clip_high=torch.tensor(1.5, dtype=D)))
    for name, lo, hi in (("bounds_float", 0.6, 1.8), ("bounds_tensor", torch.tensor(0.6), torch.tensor(1.8))):
        cases.append(dict(name=name, logprobs=_lp([0.5, 1.4]), old_logprobs=torch.zeros(2, dtype=D),
                          advantages=torch.tensor([-1.0, 1.0], dtype=D), mask=_ones(2), clip_low=lo, clip_high=hi))
    for dual in (True, False):
        cases.append(dict(name=f"dual_clip_{dual}", logprobs=_lp([5.0, 10.0, 2.0, 5.0]),
                          old_logprobs=torch.zeros(4, dtype=D), advantages=torch.tensor([-1.0, -2.0, -1.0, 1.0], dtype=D),
                          mask=_ones(4), clip_low=0.8, clip_high=1.2, dual_clip=dual, dual_clip_c=3.0))
    cases.append(dict(name="per_sequence_advantages", logprobs=torch.zeros(2, 3, dtype=D),
                      old_logprobs=torch.zeros(2, 3, dtype=D), advantages=torch.tensor([1.0, -2.0], dtype=D),
                      mask=torch.ones(2, 3, dtype=torch.bool), clip_low=0.8, clip_high=1.2))
    cases.append(dict(name="tis", logprobs=torch.zeros(2, dtype=D), old_logprobs=torch.zeros(2, dtype=D),
                      advantages=torch.ones(2, dtype=D), mask=_ones(2), clip_low=0.8, clip_high=1.2,
                      rollout_logprobs=torch.tensor([-math.log(3.0), -math.log(1.5)], dtype=D),
                      correction="tis", correction_cap=2.0))
    cases.append(dict(name="mis_token", logprobs=torch.zeros(3, dtype=D), old_logprobs=torch.zeros(3, dtype=D),
                      advantages=torch.ones(3, dtype=D), mask=_ones(3), clip_low=0.8, clip_high=1.2,
                      rollout_logprobs=torch.tensor([-math.log(3.0), -math.log(1.5), math.log(2.0)], dtype=D),
                      correction="mis-token", correction_cap=2.0))
    lw = torch.tensor([[math.log(1.5), math.log(1.5)], [math.log(1.5), math.log(1.2)]], dtype=D)
    for sw in ("product", "geometric"):
        cases.append(dict(name=f"mis_seq_{sw}", logprobs=torch.zeros(2, 2, dtype=D),
                          old_logprobs=torch.zeros(2, 2, dtype=D), advantages=torch.ones(2, dtype=D),
                          mask=torch.ones(2, 2, dtype=torch.bool), clip_low=0.8, clip_high=1.2,
                          rollout_logprobs=-lw, correction="mis-seq", correction_cap=2.0, mis_seq_weight=sw))
    cases.append(dict(name="kl_entropy", logprobs=torch.tensor([0.5, -0.5], dtype=D),
                      old_logprobs=torch.tensor([0.5, -0.5], dtype=D), advantages=torch.zeros(2, dtype=D),
                      mask=_ones(2), clip_low=0.8, clip_high=1.2, ref_logprobs=torch.zeros(2, dtype=D),
                      kl_coef=0.1, kl_type="k2", entropy=torch.tensor([1.0, 3.0], dtype=D), entropy_coef=0.01))
    cases.append(dict(name="ref_only_logs", logprobs=torch.tensor([0.5], dtype=D), old_logprobs=torch.tensor([0.5], dtype=D),
                      advantages=torch.ones(1, dtype=D), mask=_ones(1), clip_low=0.8, clip_high=1.2,
                      ref_logprobs=torch.zeros(1, dtype=D), kl_type="k1"))
    r16 = torch.tensor([math.log(x) for x in [0.9, 0.7, 1.0, 1.0]], dtype=D)
    for name, lo, hi, eps_high in (("phantom", 0.8, 1.28, 0.28), ("phantom_calibrated", 0.4, 1.8, None)):
        cases.append(dict(name=name, logprobs=_lp([0.5, 0.5, 1.0, 0.5]), old_logprobs=torch.zeros(4, dtype=D),
                          advantages=torch.tensor([-1.0, -1.0, -1.0, 1.0], dtype=D), mask=_ones(4),
                          clip_low=lo, clip_high=hi, shadow_log_ratio=r16, shadow_eps_low=0.2,
                          shadow_eps_high=eps_high))
    cases.append(dict(name="padding_nan", logprobs=torch.tensor([[0.1, float("nan")], [0.2, 0.3]], dtype=D),
                      old_logprobs=torch.tensor([[0.0, float("inf")], [0.0, float("nan")]], dtype=D),
                      advantages=torch.tensor([[1.0, float("nan")], [-1.0, float("nan")]], dtype=D),
                      mask=torch.tensor([[True, False], [True, False]]), clip_low=0.8, clip_high=1.28))
    g = torch.Generator().manual_seed(1)
    lp, old = torch.randn(4, 6, dtype=D, generator=g) * 0.3, torch.randn(4, 6, dtype=D, generator=g) * 0.3
    adv, mask = torch.randn(4, dtype=D, generator=g), torch.rand(4, 6, generator=g) > 0.3
    mask[:, 0] = True
    cases.append(dict(name="normaliser_full", logprobs=lp, old_logprobs=old, advantages=adv, mask=mask,
                      clip_low=0.8, clip_high=1.28))
    for i, sl in enumerate((slice(0, 1), slice(1, 4))):
        cases.append(dict(name=f"normaliser_shard{i}", logprobs=lp[sl], old_logprobs=old[sl], advantages=adv[sl],
                          mask=mask[sl], clip_low=0.8, clip_high=1.28, num_tokens=mask.sum()))
    for i, adv2 in enumerate(([1.0, -1.0], [1.0, 1.0])):  # test_config: the YAML section's keywords
        cases.append(dict(name=f"config_sum_norm_{i}", logprobs=torch.zeros(2, 4), old_logprobs=torch.zeros(2, 4),
                          advantages=torch.tensor(adv2), mask=torch.ones(2, 4, dtype=torch.bool),
                          clip_low=0.8, clip_high=1.2, dual_clip=False, dual_clip_c=3.0,
                          loss_agg_mode="seq-mean-token-sum-norm", correction=None, correction_cap=2.0,
                          mis_seq_weight="product", kl_coef=0.0, kl_type="k3", entropy_coef=0.0,
                          log_ratio_clamp=20.0, max_response_length=8))
    return cases


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CORRECTIONS = (None, "tis", "mis-token", ("mis-seq", "product"), ("mis-seq", "geometric"))
DTYPES = (torch.float64, torch.float32, torch.bfloat16)


def _grid_case(i: int, mode: str, corr: Any, dual: bool, g: torch.Generator) -> dict[str, Any]:
    """One seeded random batch; the other options cycle with the case index i."""
    one_d = i % 7 == 3
    b, t = (1, 5 + i % 3) if one_d else (1 + i % 4, 2 + i % 6)
    shape = (t,) if one_d else (b, t)
    dtype = DTYPES[i % 3]
    scale = 0.05 + 0.6 * ((i * 5) % 7) / 6
    lp = torch.randn(shape, dtype=D, generator=g) * scale - 1.0
    old = lp + torch.randn(shape, dtype=D, generator=g) * scale
    mask = torch.rand(shape, generator=g) > 0.25
    mask[..., 0] = True
    if i % 5 == 0:  # a fully padded row (seq modes skip it) and a huge log-ratio (the clamp)
        if not one_d and b > 1:
            mask[-1] = False
        lp[(0,) * len(shape)] = 30.0 if i % 2 else -30.0
        mask[(0,) * len(shape)] = True
    per_seq = (i % 2 == 0) and not one_d
    adv = torch.randn((b,) if per_seq else shape, dtype=D, generator=g) * 1.5
    if i % 4 == 1:
        adv = torch.where(adv.abs() < 0.3, torch.zeros_like(adv), adv)  # exact zeros: neither sign
    case: dict[str, Any] = dict(name=f"grid_{i}_{mode}_{corr}_{dual}", loss_agg_mode=mode, dual_clip=dual)
    case["dual_clip_c"] = 1.5 + (i % 3)
    lo, hi = 0.55 + 0.05 * (i % 6), 1.1 + 0.15 * (i % 5)
    case["clip_low"], case["clip_high"] = (torch.tensor(lo), torch.tensor(hi)) if i % 3 == 1 else (lo, hi)
    case["log_ratio_clamp"] = 20.0 if i % 4 else 5.0
    if corr is not None or i % 3 == 0:  # rollout log-probs: the probability-error metric
        case["rollout_logprobs"] = old + torch.randn(shape, dtype=D, generator=g) * (0.1 + scale)
    if corr is not None:
        case["correction"] = corr[0] if isinstance(corr, tuple) else corr
        if isinstance(corr, tuple):
            case["mis_seq_weight"] = corr[1]
        case["correction_cap"] = (2.0, 1.5, 3.0)[i % 3]
    if i % 2 == 1 or i % 5 == 0:
        case["ref_logprobs"] = lp + torch.randn(shape, dtype=D, generator=g) * 0.4
        case["kl_type"] = ("k1", "k2", "k3")[i % 3]
        case["kl_coef"] = 0.0 if i % 4 == 3 else 0.05
    if i % 3 != 2:
        case["entropy"] = torch.rand(shape, dtype=D, generator=g) * 3.0
        case["entropy_coef"] = 0.0 if i % 4 == 0 else 0.01
    if i % 2 == 0:
        case["shadow_log_ratio"] = (lp - old) * 0.5 + torch.randn(shape, dtype=D, generator=g) * 0.05
        case["shadow_eps_low"] = 0.2
        case["shadow_eps_high"] = (0.28, None)[i % 4 // 2]
    n_tok, n_seq = int(mask.sum()), int(mask.reshape(-1, shape[-1]).any(-1).sum())
    if i % 3 == 2:  # the global normaliser of a larger step (this shard is one part of it)
        if mode == "token-mean":
            case["num_tokens"] = torch.tensor(float(n_tok + 3))
        else:
            case["num_sequences"] = float(n_seq + 1)
        if mode == "seq-mean-token-mean" and i % 2 == 0:
            case["seq_num_tokens"] = mask.reshape(-1, shape[-1]).sum(-1) + 2
    if mode == "seq-mean-token-sum-norm" and i % 2 == 1:
        case["max_response_length"] = t + 4
    for key in ("rollout_logprobs", "ref_logprobs", "entropy", "shadow_log_ratio"):
        if key in case:  # garbage under padding must never leak
            case[key] = torch.where(mask, case[key], torch.full_like(case[key], float("nan")))
    lp = torch.where(mask, lp, torch.full_like(lp, float("inf")))
    case.update(logprobs=lp.to(dtype), old_logprobs=torch.where(mask, old, torch.full_like(old, float("nan"))),
                advantages=adv, mask=mask)
    if i % 6 == 5:
        case["validate"] = False
    return case


def _grid_cases() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(26)
    combos = itertools.product(MODES, CORRECTIONS, (False, True))
    return [_grid_case(i, mode, corr, dual, g) for i, (mode, corr, dual) in enumerate(combos)]


def build_cases() -> list[dict[str, Any]]:
    return _hand_cases() + _grid_cases()


def run_case(loss_fn: Callable[..., Any], case: dict[str, Any]) -> dict[str, Any]:
    """Call loss_fn(logprobs, old, adv, mask, **keywords), backward, and collect everything."""
    kw = {k: v for k, v in case.items() if k != "name" and k not in TENSOR_KEYS}
    lp = case["logprobs"].clone().requires_grad_(True)
    if "entropy" in kw:
        kw["entropy"] = kw["entropy"].clone().requires_grad_(True)
    loss, metrics = loss_fn(lp, case["old_logprobs"], case["advantages"], case["mask"], **kw)
    loss.backward()
    scalar = {k: v for k, v in metrics.items() if k not in ("counts", "extrema")}
    return {
        "loss": loss.detach(),
        "grad_logprobs": lp.grad,
        "grad_entropy": kw["entropy"].grad if "entropy" in kw else None,
        "metric_keys": list(metrics),
        "metrics": scalar,
        "count_keys": list(metrics["counts"]),
        "counts": dict(metrics["counts"]),
        "extrema_keys": list(metrics["extrema"]),
        "extrema": dict(metrics["extrema"]),
    }


def record() -> None:
    import megatron_calibclip.rl as rl

    if hasattr(rl, "LossInputs"):  # the records came with issue 26's rewrite
        raise SystemExit(f"{rl.__file__} is the rewritten loss, not commit {RECORDED_AT}'s: put a "
                         f"checkout of {RECORDED_AT} first on PYTHONPATH (module docstring)")
    machine = machine_key()
    cases = build_cases()
    outputs = [run_case(rl.policy_loss, c) for c in cases]
    path = fixture_path(machine)
    DATA.mkdir(exist_ok=True)
    torch.save({"commit": RECORDED_AT, "machine": machine, "cases": cases, "outputs": outputs}, path)
    print(f"recorded {len(cases)} cases of {rl.__file__} ({machine}) -> {path}")


if __name__ == "__main__":
    record()
