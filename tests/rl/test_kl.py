"""k1/k2/k3 values and gradients against their closed forms; k3's clamps."""
import math

import pytest
import torch

from megatron_calibclip.rl import kl_penalty


@pytest.mark.parametrize("d", [0.5, -0.3, 0.0, 2.0])
def test_values_and_gradients(d):
    # d = log pi_theta - log pi_ref
    expected = {
        "k1": (d, 1.0),
        "k2": (0.5 * d * d, d),
        "k3": (math.exp(-d) - 1.0 + d, 1.0 - math.exp(-d)),
    }
    for kind, (value, grad) in expected.items():
        lp = torch.tensor([d - 1.0], dtype=torch.float64, requires_grad=True)
        ref = torch.tensor([-1.0], dtype=torch.float64, requires_grad=True)
        kl = kl_penalty(lp, ref, kind)
        kl.sum().backward()
        assert kl.item() == pytest.approx(value, abs=1e-12), kind
        assert lp.grad.item() == pytest.approx(grad, abs=1e-12), kind
        assert ref.grad is None  # the reference is a constant


def test_k2_k3_nonnegative_k1_signed():
    d = torch.linspace(-3, 3, 61, dtype=torch.float64)
    ref = torch.zeros_like(d)
    assert (kl_penalty(d, ref, "k2") >= 0).all()
    assert (kl_penalty(d, ref, "k3") >= 0).all()
    assert (kl_penalty(d, ref, "k1") < 0).any()


def test_k3_clamp():
    # pi_ref >> pi_theta: exp(30) would dominate; -d clamped to 20, then k3 clamped to 10
    lp = torch.tensor([-30.0], dtype=torch.float64, requires_grad=True)
    kl = kl_penalty(lp, torch.zeros(1, dtype=torch.float64), "k3")
    kl.sum().backward()
    assert kl.item() == 10.0
    assert lp.grad.item() == 0.0
    # with a looser k3 clamp the log-ratio clamp is what bounds it: exp(20) - 1 - 20
    kl2 = kl_penalty(torch.tensor([-30.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), "k3",
                     k3_clamp=1e12)
    assert kl2.item() == pytest.approx(math.exp(20) - 21)


def test_errors():
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k5")
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "k1")
