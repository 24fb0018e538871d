"""(f, `padding`) Left-padded batches through the trainer's path give each row's own
log-probs, on the attention the device really runs.

Why on the device: TE's cuDNN fused attention reduces a `padding_causal` mask to one length
per row and takes columns [0, len) as valid, so a left-padded row would attend to its padding
and lose its tail, silently (policy, shadow and reference alike). The trainer puts every row's
valid tokens first (trainer/layout.py); this case checks it where cuDNN runs: rows of four
lengths, left-padded into one batch with the trainer's key mask, through trainer/forward.py
compute_logprobs, against each row alone, unpadded, through the same path. Thresholds: those
of a batch-composition change in BF16 (section c's, widened for the other sequence lengths'
kernels). `unfixed` records the same batch through the model directly, left-padded as it
arrives (no layout change): on cuDNN it shows what the fix removes; it is recorded, not
judged (another attention backend may honour the mask). On the CPU the same function runs on
the TE stand-in (tests/bench/test_gpu_check_padding.py), where `unfixed` must be far off.
"""
from __future__ import annotations

import torch

from megatron_calibclip.parallel.devices import HOST

THRESHOLDS = {"max_abs_logprob_diff": 5e-2, "mean_abs_logprob_diff": 2e-3}
FRACTIONS = (1.0, 0.75, 0.5, 0.3)  # each row's share of the batch width


def _rows(vocab: int, width: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator(device=HOST).manual_seed(17)  # the same rows on any device
    lengths = [max(4, int(width * f)) for f in FRACTIONS]
    return [torch.randint(1, vocab, (n,), generator=gen, device=HOST).to(device)
            for n in lengths]


def left_padded(rows: list[torch.Tensor], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [b, width] with every row at the right end (rollout/batch.py's layout) and
    megatron's key mask [b, 1, 1, width], True = padding."""
    device = rows[0].device
    tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.ones(len(rows), 1, 1, width, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        tokens[i, width - len(row):] = row
        mask[i, 0, 0, width - len(row):] = False
    return tokens, mask


def _trainer_logprobs(model, cfg, tokens, mask) -> torch.Tensor:
    from megatron_calibclip.trainer.forward import compute_logprobs

    lp, _ = compute_logprobs(model, tokens, mask, vocab_size=cfg.vocab_size, temperature=1.0,
                             micro_batch_size=tokens.shape[0], pad_id=0)
    return lp.float()


def _unfixed_logprobs(model, cfg, tokens, mask) -> torch.Tensor:
    """The batch through the model as it arrives, left padding in front (no layout change)."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    return shifted_logprobs_entropy(forward_logits(model, tokens, mask), tokens,
                                    cfg.vocab_size)[0].float()


def _row_diffs(padded: torch.Tensor, alone: list[torch.Tensor]) -> torch.Tensor:
    width = padded.shape[1] + 1
    return torch.cat([(padded[i, width - 1 - a.shape[1]:] - a[0]).abs()
                      for i, a in enumerate(alone)])


def check_padding(model, cfg, width: int, device: str) -> dict:
    """Left-padded rows vs each row alone, through the trainer's log-prob path (eval, no
    grad, the model's current precision)."""
    rows = _rows(cfg.vocab_size, width, device)
    tokens, mask = left_padded(rows, width)
    no_mask = lambda r: torch.zeros(1, 1, 1, len(r), dtype=torch.bool, device=device)  # noqa: E731
    with torch.no_grad():
        alone = [_trainer_logprobs(model, cfg, r[None], no_mask(r)) for r in rows]
        fixed = _row_diffs(_trainer_logprobs(model, cfg, tokens, mask), alone)
        unfixed = _row_diffs(_unfixed_logprobs(model, cfg, tokens, mask), alone)
    out = {"ran": True, "lengths": [len(r) for r in rows], "width": width,
           "padded_vs_alone": {"max": fixed.max().item(), "mean": fixed.mean().item()},
           "unfixed_vs_alone": {"max": unfixed.max().item(), "mean": unfixed.mean().item()},
           "thresholds": THRESHOLDS}
    out["passed"] = bool(torch.isfinite(fixed).all()) and (
        out["padded_vs_alone"]["max"] <= THRESHOLDS["max_abs_logprob_diff"]
        and out["padded_vs_alone"]["mean"] <= THRESHOLDS["mean_abs_logprob_diff"])
    return out
