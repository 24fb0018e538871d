"""Bit-identity with the single-function policy_loss of commit 0bffeb9 (issue 26).

The fixture holds the old code's outputs on 51 cases (policy_loss_reference.py says how it
was made), one file per kind of CPU: the old code's float64 answer itself differs in the last
bits between an AVX2 AMD and an AVX-512 Intel CPU. On a recorded kind every loss, gradient,
metric, count and extremum must be torch.equal, and every key list must keep its order. On
another kind nothing bit-exact is on record: values must then agree with the first recording
to within 16 units in the last place of their dtype (the two recordings differ by at most 3.2),
integers and key lists exactly.
"""
import dataclasses

import pytest
import torch

from megatron_calibclip.rl import LossConfig, LossInputs, policy_loss
from tests.rl.policy_loss_reference import fixture_path, machine_key, recorded_machines, run_case

MACHINE = machine_key()
BIT_EXACT = MACHINE in recorded_machines()
RECORDED = torch.load(fixture_path(MACHINE if BIT_EXACT else recorded_machines()[0]), weights_only=True)
CASES = list(zip(RECORDED["cases"], RECORDED["outputs"]))
ULPS = 16  # the tolerance on a CPU of no recorded kind


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    tol = ULPS * torch.finfo(a.dtype).eps
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol, equal_nan=True)


def _equal(a, b, exact: bool) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if not (a.dtype == b.dtype and a.shape == b.shape):
        return False
    return torch.equal(a, b) if exact else _close(a, b)


def assert_same(out: dict, ref: dict, exact: bool = BIT_EXACT) -> None:
    for key in ("metric_keys", "count_keys", "extrema_keys"):
        assert out[key] == ref[key], key
    for key in ("loss", "grad_logprobs", "grad_entropy"):
        assert _equal(out[key], ref[key], exact), (key, out[key], ref[key])
    for group in ("metrics", "counts", "extrema"):
        for k, v in ref[group].items():
            assert _equal(out[group][k], v, exact), (group, k, out[group][k], v)


def test_fixture_covers_every_option():
    assert RECORDED["commit"] == "0bffeb9" and len(CASES) == 51
    keys = {k for _, ref in CASES for k in ref["count_keys"]}
    assert {"dual_clip_neg", "tis_capped_tokens", "mis_rejected_seqs", "kl_sum", "entropy_sum",
            "phantom_clip_neg", "shadow_clip_upper_pos"} <= keys
    assert {c["logprobs"].dtype for c, _ in CASES} == {torch.float64, torch.float32, torch.bfloat16}


def test_recordings_ask_the_same_and_differ_only_in_the_last_bits():
    """What each kind of CPU was asked is identical; the answers agree within the tolerance
    used on unrecorded CPUs (else that tolerance would not be one)."""
    machines = recorded_machines()
    assert "AVX2-AuthenticAMD" in machines and len(machines) >= 2, machines
    first = torch.load(fixture_path(machines[0]), weights_only=True)
    for machine in machines[1:]:
        other = torch.load(fixture_path(machine), weights_only=True)
        assert other.get("machine") == machine
        for a, b in zip(first["cases"], other["cases"], strict=True):
            assert a.keys() == b.keys() and a["name"] == b["name"]
            for k, v in a.items():
                same = (torch.equal(v.nan_to_num(), b[k].nan_to_num()) if isinstance(v, torch.Tensor)
                        else v == b[k])
                assert same, (a["name"], k)
        for a, b in zip(first["outputs"], other["outputs"], strict=True):
            assert_same(b, a, exact=False)


@pytest.mark.parametrize("case, ref", CASES, ids=[c["name"] for c, _ in CASES])
def test_keyword_form_is_bit_identical(case, ref):
    assert_same(run_case(policy_loss, case), ref)


def _records(case: dict) -> tuple[LossInputs, LossConfig, dict]:
    """Sort a case's keywords into the two records by hand (not through the keyword form)."""
    inputs = {k: v for k, v in case.items() if k in INPUT_NAMES}
    options = {k: v for k, v in case.items() if k in fields_of(LossConfig)}
    if options.get("correction", "none") is None:
        options["correction"] = "none"
    rest = {k: v for k, v in case.items() if k not in inputs and k not in options and k != "name"}
    return LossInputs(**inputs), LossConfig(**options), rest


@pytest.mark.parametrize("case, ref", CASES, ids=[c["name"] for c, _ in CASES])
def test_record_form_is_bit_identical(case, ref):
    """policy_loss(LossInputs, config=LossConfig) - the trainer's call - gives the recorded outputs."""
    inputs, config, rest = _records(case)
    assert set(rest) <= {"clip_low", "clip_high", "validate"}

    def record_form(lp, old, adv, mask, **kw):
        entropy = kw.get("entropy")
        inp = dataclasses.replace(inputs, logprobs=lp, entropy=entropy)
        return policy_loss(inp, config=config, clip_low=rest["clip_low"], clip_high=rest["clip_high"],
                           validate=rest.get("validate", True))

    assert_same(run_case(record_form, case), ref)


def fields_of(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


INPUT_NAMES = fields_of(LossInputs)
