"""Per-token log-probs do not depend on padding or on how an attention backend reads the mask
(issue 37, finding 3). Batches arrive left-padded (rollout/batch.py); TE's cuDNN fused attention
reduces a padding_causal mask to lengths and treats positions [0, len) of each row as valid
(models/te_stand_in.py), so a left-padded row would attend to its padding and lose its tail.

Reference: every row alone, unpadded, in one process (TP = PP = 1) through the plain emulated
spec. Checked through the trainer's own log-prob path (trainer/forward.py compute_logprobs) at
TP=2 and PP=2, for two amounts of left padding, with torch-style masks (emulated spec) and with
cuDNN's length-only reading (the TE stand-in)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.dist

PRESET = "tiny-qwen3"
LENGTHS = [9, 14, 5, 11]  # real tokens per row
EXTRA_PAD = [0, 6]  # left padding beyond the longest row


def _rows(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, vocab, (n,), generator=g) for n in LENGTHS]


def _left_padded(rows: list[torch.Tensor], extra: int, pad_id: int = 0):
    """tokens [b, s] with each row at the right end, and megatron's key mask (True = padding)."""
    width = max(len(r) for r in rows) + extra
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.ones(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, width - len(r):] = r
        mask[i, width - len(r):] = False
    return tokens, mask[:, None, None, :]


def _logprobs(model, tokens, mask, vocab):
    from megatron_calibclip.trainer.forward import compute_logprobs

    lp, _ = compute_logprobs(model, tokens, mask, vocab_size=vocab, temperature=1.0,
                             micro_batch_size=2, pad_id=0)
    return lp


def _reference_body(rank, world_size):
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.models.layer_specs import emulated_layer_spec
    from megatron_calibclip.parallel import model_parallel

    with model_parallel():
        cfg = get_preset(PRESET)
        model = build_policy_model(cfg, seed=0, spec=emulated_layer_spec(cfg))
        rows = _rows(cfg.vocab_size)  # alone, nothing masked
        return [_logprobs(model, r[None], torch.zeros(1, 1, 1, len(r), dtype=torch.bool),
                          cfg.vocab_size)[0] for r in rows]


def _padded_body(rank, world_size, tp, pp):
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.models.layer_specs import emulated_layer_spec
    from megatron_calibclip.models.te_stand_in import te_stand_in_layer_spec
    from megatron_calibclip.parallel import model_parallel

    out = {}
    with model_parallel(tp=tp, pp=pp):
        cfg = get_preset(PRESET)
        rows = _rows(cfg.vocab_size)
        specs = (("torch-mask", emulated_layer_spec(cfg)),
                 ("cudnn-lengths", te_stand_in_layer_spec(cfg)))
        for name, spec in specs:
            model = build_policy_model(cfg, seed=0, spec=spec)
            for extra in EXTRA_PAD:
                tokens, mask = _left_padded(rows, extra)
                out[(name, extra)] = _logprobs(model, tokens, mask, cfg.vocab_size)
    return out


@pytest.fixture(scope="module")
def reference(dist_pool):
    return dist_pool(1).run(_reference_body)[0]


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_padding_invariance_of_logprobs_under_torch_and_cudnn_masks(dist_pool, reference, tp, pp):
    results = dist_pool(2).run(_padded_body, tp, pp)
    for rank_out in results:  # every rank of the replica holds the same log-probs
        for (name, extra), lp in rank_out.items():
            width = lp.shape[1] + 1
            for i, ref in enumerate(reference):
                n = LENGTHS[i]
                got = lp[i, width - n:]  # scores of the row's tokens 2..n
                worst = (got - ref).abs().max().item()
                assert worst <= 1e-6, f"{name}, {extra} extra padding, row {i}: {worst:.3g}"


def test_padding_invariance_layout_puts_valid_tokens_first_and_restores_columns():
    """trainer/layout.py against rows moved by hand: tokens from column 0, every masked key at
    the end (what cuDNN's lengths assume); a dummy row (all masked) stays; logits come back in
    the batch's own columns, and a gradient through them reaches every original column."""
    from megatron_calibclip.trainer.layout import restore_columns, valid_tokens_first

    rows = [torch.arange(1, n + 1) * 10 for n in (3, 6, 1)]
    tokens, mask = _left_padded(rows, extra=2, pad_id=0)
    tokens = torch.cat([tokens, torch.zeros(1, tokens.shape[1], dtype=torch.long)])
    mask = torch.cat([mask, torch.ones(1, 1, 1, tokens.shape[1], dtype=torch.bool)])
    moved, moved_mask, shift = valid_tokens_first(tokens, mask)
    width = tokens.shape[1]
    for i, r in enumerate(rows):
        expected = torch.cat([r, torch.zeros(width - len(r), dtype=torch.long)])
        assert torch.equal(moved[i], expected)
        assert moved_mask[i, 0, 0].tolist() == [False] * len(r) + [True] * (width - len(r))
    assert torch.equal(moved[-1], tokens[-1]) and bool(moved_mask[-1].all())

    logits = moved.float()[..., None].repeat(1, 1, 3).requires_grad_()  # [b, s, v]
    back = restore_columns(logits, shift)
    assert torch.equal(back[..., 0].long(), tokens)
    back.sum().backward()
    assert torch.equal(logits.grad, torch.ones_like(logits))

    plain = torch.zeros(2, 1, 1, 4, dtype=torch.bool)  # no leading padding: nothing moves
    t = torch.arange(8).view(2, 4)
    assert valid_tokens_first(t, plain)[2] is None and valid_tokens_first(t, None)[2] is None
