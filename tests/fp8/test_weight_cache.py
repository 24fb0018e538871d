"""The weight-operand cache of the emulated linears: bit-identical to re-quantizing at every
forward (the reference: policy "off"), for every recipe, at TP=2 with delayed scaling's amax
all-reduce; computed once per weight version; a write that bypasses the version counter is
caught by the "verify" policy and cured by invalidate_weight_caches()."""
import pytest
import torch

from megatron_calibclip.fp8 import FP8Recipe

from tests.fp8.test_linear import BATCH, FFN, HIDDEN, SEQ, _pair

CASES = [
    ("bf16", None),
    ("fp8", dict(format="hybrid", granularity="tensorwise")),
    ("fp8", dict(format="hybrid", granularity="delayed", amax_history_len=4)),
    ("fp8", dict(format="e4m3", granularity="rowwise")),
    ("fp8", dict(format="hybrid", granularity="blockwise")),
    ("fp8", dict(format="hybrid", granularity="mxfp8")),
    ("fp8", dict(format="e4m3", granularity="tensorwise", weight_source="fp32")),
    ("fp8", dict(format="hybrid", granularity="rowwise", backend="torch")),
]


def _sequence(col, row, weights, x, grad):
    """Train-like use: grad forward/backward, in-place update, no-grad forwards (a rollout
    decoding with unchanged weights), another update, a forward after load-style copy_."""
    from megatron_calibclip.fp8.precision import reset_fp8_state

    with torch.no_grad():
        col.weight.copy_(weights[0])
        row.weight.copy_(weights[1])
    for m in (col, row):
        m.weight.grad = None
    reset_fp8_state(torch.nn.ModuleList([col, row]))
    outs = []

    def fwd_bwd():
        xi = x.clone().requires_grad_(True)
        out = row(col(xi)[0])[0]
        (out * grad).sum().backward()
        outs.extend([out.detach(), xi.grad, col.weight.grad.clone(), row.weight.grad.clone()])

    def fwd_only(n):
        with torch.no_grad():
            for i in range(n):
                outs.append(row(col(x[: i + 1])[0])[0])

    fwd_bwd()
    with torch.no_grad():  # an optimizer step
        col.weight.add_(col.weight.grad, alpha=-1e-2)
        row.weight.add_(row.weight.grad, alpha=-1e-2)
    fwd_only(3)
    fwd_bwd()
    with torch.no_grad():  # load_state_dict copies in place
        col.weight.copy_(weights[0] * 1.01)
    fwd_only(2)
    return outs


def _cache_body(rank, world_size):
    from megatron_calibclip.fp8 import (EmulatedColumnParallelLinear, EmulatedRowParallelLinear,
                                        set_precision)
    from megatron_calibclip.fp8.weight_cache import set_weight_cache_policy
    from megatron_calibclip.parallel import model_parallel

    results = {}
    with model_parallel(tp=2):
        col, row = _pair(2, EmulatedColumnParallelLinear, EmulatedRowParallelLinear)
        pair = torch.nn.ModuleList([col, row])
        g = torch.Generator().manual_seed(11 + rank)
        weights = (torch.randn(col.weight.shape, generator=g) * 0.05,
                   torch.randn(row.weight.shape, generator=g) * 0.05)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5))
        grad = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(6))
        for mode, kw in CASES:
            set_precision(pair, mode, FP8Recipe(**kw) if kw else None)
            runs = {}
            try:
                for policy in ("off", "on", "verify"):
                    set_weight_cache_policy(policy)
                    before = col.weight_cache.builds + row.weight_cache.builds
                    runs[policy] = _sequence(col, row, weights, x, grad)
                    runs[policy + "_builds"] = col.weight_cache.builds + row.weight_cache.builds - before
            finally:
                set_weight_cache_policy(None)
            key = f"{mode}:{sorted(kw.items()) if kw else ''}"
            results[key] = {
                "on": all(torch.equal(a, b) for a, b in zip(runs["off"], runs["on"])),
                "verify": all(torch.equal(a, b) for a, b in zip(runs["off"], runs["verify"])),
                "n": len(runs["off"]), "off_builds": runs["off_builds"],
                "on_builds": runs["on_builds"],
            }
    return results


@pytest.mark.dist
def test_cache_is_bit_identical_to_requantizing(dist_pool):
    for rank, res in enumerate(dist_pool(2).run(_cache_body, timeout=300)):
        assert len(res) == len(CASES)
        for key, r in res.items():
            assert r["n"] == 4 + 3 + 4 + 2, key
            assert r["on"], f"rank {rank} {key}: cached operands changed a result"
            assert r["verify"], f"rank {rank} {key}: verify policy changed a result"
            # off: every forward of each linear builds (1+3+1+2 = 7 forwards x 2 linears);
            # on: one build per weight version met: initial copy, update, load (column only)
            # -> 2 + 2 + 1; delayed scaling also rebuilds when its scale moves
            assert r["off_builds"] == 14, (key, r)
            if "delayed" in key:
                assert 5 <= r["on_builds"] < 14, (key, r)
            else:
                assert r["on_builds"] == 5, (key, r)


def _stale_body(rank, world_size):
    from megatron_calibclip.fp8 import (EmulatedColumnParallelLinear, EmulatedRowParallelLinear,
                                        set_precision)
    from megatron_calibclip.fp8.weight_cache import (StaleWeightCacheError,
                                                     invalidate_weight_caches,
                                                     set_weight_cache_policy)
    from megatron_calibclip.parallel import model_parallel

    out = {}
    with model_parallel(tp=1):
        col, _ = _pair(1, EmulatedColumnParallelLinear, EmulatedRowParallelLinear)
        set_precision(col, "fp8", FP8Recipe(granularity="tensorwise"))
        with torch.no_grad():
            col.weight.copy_(torch.randn(col.weight.shape, generator=torch.Generator().manual_seed(2)))
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
        try:
            set_weight_cache_policy("verify")
            with torch.no_grad():
                col(x)
                col.weight.data.mul_(2.0)  # through .data: the version counter does not move
                try:
                    col(x)
                    out["raised"] = None
                except StaleWeightCacheError as err:
                    out["raised"] = str(err)
                invalidate_weight_caches()
                set_weight_cache_policy("off")
                want = col(x)[0]
                set_weight_cache_policy("verify")
                got = col(x)[0]
                out["after_invalidate"] = torch.equal(got, want)
                col.weight.data.mul_(0.5)  # again, now cured by the model-scoped invalidation
                invalidate_weight_caches(col)
                got = col(x)[0]
                set_weight_cache_policy("off")
                out["after_model_invalidate"] = torch.equal(got, col(x)[0]) and \
                    not torch.equal(got, want)
        finally:
            set_weight_cache_policy(None)
    return out


@pytest.mark.dist
def test_write_through_data_is_caught_and_invalidation_cures_it(dist_pool):
    res = dist_pool(2).run(_stale_body, timeout=120)[0]
    assert res["raised"] and "invalidate_weight_caches" in res["raised"]
    assert res["after_invalidate"] and res["after_model_invalidate"]


def test_policy_comes_from_the_environment(monkeypatch):
    from megatron_calibclip.fp8.weight_cache import set_weight_cache_policy, weight_cache_policy

    set_weight_cache_policy(None)
    monkeypatch.delenv("CALIBCLIP_WEIGHT_CACHE", raising=False)
    assert weight_cache_policy() == "on"
    monkeypatch.setenv("CALIBCLIP_WEIGHT_CACHE", "verify")
    assert weight_cache_policy() == "verify"
    monkeypatch.setenv("CALIBCLIP_WEIGHT_CACHE", "sometimes")
    with pytest.raises(ValueError, match="CALIBCLIP_WEIGHT_CACHE"):
        weight_cache_policy()
    with pytest.raises(ValueError, match="policy"):
        set_weight_cache_policy("never")


def test_a_bad_policy_in_the_environment_is_one_line(monkeypatch, capsys, tmp_path):
    from megatron_calibclip.cli import main

    monkeypatch.setenv("CALIBCLIP_WEIGHT_CACHE", "sometimes")
    assert main(["train", "--config", "tiny-cpu", "--set", f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("calibclip: CALIBCLIP_WEIGHT_CACHE='sometimes'") and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_delayed_scaling_hit_on_an_accelerator_does_not_read_scales_on_the_host():
    """A cache hit under delayed scaling compared the scale the codes were made with to the
    current one with torch.equal: on a GPU a host synchronisation per linear per forward.
    Off the CPU the weight is re-quantized instead (same operands: a miss rebuilds them).
    The meta device stands in for the accelerator: torch.equal cannot run there at all."""
    from megatron_calibclip.fp8.delayed import AmaxHistory
    from megatron_calibclip.fp8.formats import E4M3
    from megatron_calibclip.fp8.weight_cache import WeightCache, set_weight_cache_policy

    recipe = FP8Recipe(format="hybrid", granularity="delayed", amax_history_len=4)
    set_weight_cache_policy("on")
    try:
        for device, builds in (("cpu", 2), ("meta", 3)):
            weight = torch.nn.Parameter(torch.ones(32, 16, device=device))
            state = AmaxHistory(E4M3, 4, "max", 0)
            cache = WeightCache()
            for _ in range(3):
                cache.operands(weight, recipe, state)
            # CPU: the scale moves at the first record (1 -> from amax 1), then holds: one hit
            assert (cache.builds, state.updates) == (builds, 3), device
    finally:
        set_weight_cache_policy(None)
