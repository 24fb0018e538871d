"""Next-token sampling: filters, log-probs, determinism, config errors."""
import pytest
import torch

from megatron_calibclip.config import ConfigError
from megatron_calibclip.rollout import SamplingParams, sample_next


def _logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 50, generator=g) * 3


def test_logprob_is_under_the_full_tempered_distribution():
    logits = _logits()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    tok, lp = sample_next(logits, params, torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.allclose(lp, expected)


def test_greedy_and_degenerate_filters_agree():
    logits = _logits()
    greedy, _ = sample_next(logits, SamplingParams(greedy=True), torch.Generator())
    assert torch.equal(greedy, logits.argmax(-1))
    top1, _ = sample_next(logits, SamplingParams(top_k=1), torch.Generator().manual_seed(3))
    assert torch.equal(top1, greedy)
    tiny_p, _ = sample_next(logits, SamplingParams(top_p=1e-6), torch.Generator().manual_seed(4))
    assert torch.equal(tiny_p, greedy)


def test_top_k_and_top_p_restrict_the_support():
    logits = _logits()[:1].expand(4000, -1)
    tok, _ = sample_next(logits, SamplingParams(top_k=3), torch.Generator().manual_seed(5))
    assert set(tok.tolist()) == set(torch.topk(logits[0], 3).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    # nucleus 0.5: the smallest prefix of the sorted tokens whose mass reaches 0.5
    n_keep = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    tok, _ = sample_next(logits, SamplingParams(top_p=0.5), torch.Generator().manual_seed(6))
    assert set(tok.tolist()) == set(order[:n_keep].tolist())


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, -1)
    tok, _ = sample_next(logits, SamplingParams(), torch.Generator().manual_seed(7))
    freq = torch.bincount(tok, minlength=3).float() / tok.numel()
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015)


def test_seeded():
    a = sample_next(_logits(), SamplingParams(), torch.Generator().manual_seed(9))[0]
    b = sample_next(_logits(), SamplingParams(), torch.Generator().manual_seed(9))[0]
    c = sample_next(_logits(), SamplingParams(), torch.Generator().manual_seed(10))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("kw, match", [
    ({"temperature": 0}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens")])
def test_bad_params(kw, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kw)
