"""Vocab-parallel log-probs and entropy equal the dense computation, values and gradients."""
import numpy as np
import pytest
import torch

from megatron_calibclip.parallel import dense_logprobs_entropy, vocab_parallel_logprobs_entropy

pytestmark = pytest.mark.dist

TRUE_VOCAB, PADDED_VOCAB = 61, 64  # 3 padding columns, on the last TP rank


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5, PADDED_VOCAB, generator=g, dtype=torch.float64).float() * 4
    logits[..., TRUE_VOCAB:] = 50.0  # padding columns would dominate if they were counted
    logits[0, 0, 7] = 30.0  # a very peaked row
    targets = torch.randint(0, TRUE_VOCAB, (3, 5), generator=g)
    w_logp = torch.randn(3, 5, generator=g)
    w_ent = torch.randn(3, 5, generator=g)
    return logits, targets, w_logp, w_ent


def _dense_reference(logits, targets, w_logp, w_ent):
    """Independent reference: plain log_softmax over the true vocabulary, float64 autograd."""
    x = logits.double().clone().requires_grad_(True)
    logp_all = torch.log_softmax(x[..., :TRUE_VOCAB], dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()
    return logp.detach().numpy(), ent.detach().numpy(), x.grad.numpy()


def _vp_body(rank, world_size, tp):
    from megatron.core import parallel_state

    from megatron_calibclip.parallel import model_parallel
    from tests.dist_utils import gather_tp

    logits, targets, w_logp, w_ent = _case()
    with model_parallel(tp=tp):
        group = parallel_state.get_tensor_model_parallel_group()
        r = parallel_state.get_tensor_model_parallel_rank()
        shard = logits.chunk(tp, dim=-1)[r].clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs_entropy(
            shard, targets, true_vocab_size=TRUE_VOCAB, group=group
        )
        ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()
        grad = gather_tp(shard.grad, partition_dim=2)
        return logp.detach().numpy(), ent.detach().numpy(), grad.numpy()


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_equals_dense(dist_pool, tp):
    ref_logp, ref_ent, ref_grad = _dense_reference(*_case())
    for logp, ent, grad in dist_pool(tp).run(_vp_body, tp):
        assert np.abs(logp - ref_logp).max() <= 1e-6 * max(1, np.abs(ref_logp).max())
        assert np.abs(ent - ref_ent).max() <= 1e-6
        assert np.abs(grad - ref_grad).max() <= 1e-6
        assert np.all(grad[..., TRUE_VOCAB:] == 0), "padding columns get no gradient"


def test_single_process_path_and_dense_helper_agree():
    logits, targets, w_logp, w_ent = _case(1)
    ref_logp, ref_ent, ref_grad = _dense_reference(logits, targets, w_logp, w_ent)
    x = logits.clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_entropy(x, targets, true_vocab_size=TRUE_VOCAB)
    ((w_logp * logp).sum() + (w_ent * ent).sum()).backward()
    assert np.abs(logp.detach().numpy() - ref_logp).max() <= 1e-5
    assert np.abs(ent.detach().numpy() - ref_ent).max() <= 1e-5
    assert np.abs(x.grad.numpy() - ref_grad).max() <= 1e-6
    d_logp, d_ent = dense_logprobs_entropy(logits, targets, TRUE_VOCAB)
    assert torch.allclose(d_logp, logp.detach(), atol=1e-5)
    assert torch.allclose(d_ent, ent.detach(), atol=1e-5)


def test_bf16_logits_are_accumulated_in_fp32():
    logits, targets, _, _ = _case(2)
    logp, ent = vocab_parallel_logprobs_entropy(logits.bfloat16(), targets,
                                                true_vocab_size=TRUE_VOCAB)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_logp, _ = dense_logprobs_entropy(logits.bfloat16().float(), targets, TRUE_VOCAB)
    assert torch.allclose(logp, ref_logp, atol=1e-5)


def test_input_logits_are_not_modified():
    logits, targets, _, _ = _case(3)
    before = logits.clone()
    vocab_parallel_logprobs_entropy(logits, targets, true_vocab_size=TRUE_VOCAB)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "targets, match",
    [
        (torch.zeros(3, 4, dtype=torch.long), "does not match"),
        (torch.full((3, 5), TRUE_VOCAB), "target ids must be in"),
        (torch.full((3, 5), -1), "target ids must be in"),
    ],
)
def test_bad_input_is_rejected(targets, match):
    logits, _, _, _ = _case()
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs_entropy(logits, targets, true_vocab_size=TRUE_VOCAB)


def test_mask_free_kernel_is_bit_identical_to_the_masked_one():
    """benchmarks/speed/bench_logprob_kernel.py keeps the kernel as it was (masks over the
    whole vocabulary); outputs and gradients must agree bit for bit, signs of zero included."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "speed" / "bench_logprob_kernel.py"
    proc = subprocess.run([sys.executable, str(script), "--tokens", "64", "--vocab", "1000",
                           "--repeats", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["bit_identical"] is True
    assert result["before"]["forward_s"] > 0 and result["after"]["forward_s"] > 0
