"""Micro-batched forward (and backward) passes through megatron-core's pipeline schedule.

Both the log-prob recomputation (forward only) and the policy update (forward + backward)
go through `get_forward_backward_func`, so they run unchanged at any PP size. Per-token
results are produced on the last pipeline stage and broadcast over the pipeline group, so
every rank of a model replica holds the same tensors (the calibration histograms and the
metrics then need no knowledge of stages).

Micro-batches must share one shape under PP (the p2p buffers are preallocated), so a
batch is padded with dummy rows (all padding, fully masked) to a multiple of the
micro-batch size; dummy rows never reach a loss or a metric.

Transformer Engine's FP8 GEMMs need token counts that divide by 16 (32 for MXFP8): a model
built for them carries `calibclip_token_multiple` (trainer/te_run.py), and every
micro-batch is then padded on the right (masked keys; under the causal mask no real token
sees them) and its logits cut back before the loss.

Every micro-batch reaches the model with its valid tokens first (trainer/layout.py: left
padding rotated behind the tokens, logits rotated back), since TE's cuDNN attention reads a
padding mask as lengths.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_calibclip.fp8.delayed import batched_amax_reduction
from megatron_calibclip.models.forward import position_ids_for
from megatron_calibclip.parallel.devices import model_device
from megatron_calibclip.trainer.layout import restore_columns, valid_tokens_first
from megatron_calibclip.parallel.vocab_parallel import vocab_parallel_logprobs_entropy


def _pad_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    if rows == 0:
        return t
    pad = torch.full((rows, *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0)


def split_micro_batches(tensors: dict[str, torch.Tensor], micro_batch_size: int,
                        pad_values: dict[str, Any]) -> tuple[list[dict], int]:
    """Cut [B, ...] tensors into equal micro-batches (padding B up); returns (list, B)."""
    b = next(iter(tensors.values())).shape[0]
    mbs = min(micro_batch_size, b)
    n = -(-b // mbs)
    extra = n * mbs - b
    padded = {k: _pad_rows(v, extra, pad_values.get(k, 0)) for k, v in tensors.items()}
    return [{k: v[i * mbs:(i + 1) * mbs] for k, v in padded.items()} for i in range(n)], b


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted per-token log-probs and entropies of softmax(logits / T), vocab-parallel."""
    scaled = logits if temperature == 1.0 else logits.float() / temperature
    return vocab_parallel_logprobs_entropy(
        scaled[:, :-1], tokens[:, 1:], true_vocab_size=vocab_size,
        group=ps.get_tensor_model_parallel_group(),
    )


def broadcast_from_last_stage(t: Optional[torch.Tensor], shape, dtype,
                              device: torch.device) -> torch.Tensor:
    """The last pipeline stage's tensor, on every stage of this replica (other stages
    receive into a buffer on `device`: where the last stage's tensor lives)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return t
    buf = (t.contiguous() if ps.is_pipeline_last_stage()
           else torch.empty(shape, dtype=dtype, device=device))
    dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return buf


def token_multiple(model) -> int:
    """What each micro-batch's sequence length must divide by for `model` (or the module
    it wraps): 1, or what the trainer set for TE's FP8 GEMMs."""
    while model is not None:
        multiple = getattr(model, "calibclip_token_multiple", None)
        if multiple:
            return int(multiple)
        model = getattr(model, "module", None)
    return 1


def pad_to_multiple(tokens: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    multiple: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """tokens [b, s] (and the key-padding mask [b, 1, 1, s], True = masked) padded on the
    right to a multiple of `multiple` columns; the new keys are masked."""
    extra = -tokens.shape[1] % multiple
    if not extra:
        return tokens, attention_mask
    tokens = torch.nn.functional.pad(tokens, (0, extra))
    if attention_mask is not None:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, extra), value=True)
    return tokens, attention_mask


def run_schedule(model, micro_batches: list[dict], loss_fn: Callable, *, forward_only: bool,
                 seq_length: int) -> list[dict]:
    """Run megatron's schedule over `micro_batches`; returns the loss_fn outputs (last stage).

    loss_fn(micro_batch, logits) -> (loss 0-d tensor, dict of per-micro-batch outputs).
    """
    multiple = token_multiple(model)

    def forward_step(data_iterator, mdl):
        mb = next(data_iterator)
        # valid tokens first (trainer/layout.py): the layout every attention backend reads alike
        tokens, mask, shift = valid_tokens_first(mb["tokens"], mb.get("attention_mask"))
        tokens, mask = pad_to_multiple(tokens, mask, multiple)
        out = mdl(tokens, position_ids_for(tokens), mask)

        def loss_func(logits):
            # the padding columns (if any) go here; rows back in the batch's own columns
            logits = restore_columns(logits[:, :seq_length], shift)
            loss, outputs = loss_fn(mb, logits)
            return loss, torch.zeros((), dtype=torch.int, device=loss.device), outputs

        return out, loss_func

    # delayed scaling: the amaxes of a micro-batch's forward and backward are reduced in one
    # collective (per amax group), as TE reduces a region's; the same scales as one per tensor
    with batched_amax_reduction():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=seq_length + (-seq_length % multiple),
            micro_batch_size=micro_batches[0]["tokens"].shape[0],
            forward_only=forward_only,
        )


@torch.no_grad()
def compute_logprobs(model, tokens: torch.Tensor, attention_mask: torch.Tensor, *,
                     vocab_size: int, temperature: float, micro_batch_size: int,
                     pad_id: int, with_entropy: bool = False
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs [B, S-1] (and entropies) of `tokens` under `model`, no grad."""
    mbs, b = split_micro_batches({"tokens": tokens, "attention_mask": attention_mask},
                                 micro_batch_size, {"tokens": pad_id, "attention_mask": True})

    def loss_fn(mb, logits):
        lp, ent = token_logprobs(logits, mb["tokens"], vocab_size, temperature)
        return torch.zeros((), device=lp.device), {"lp": lp, "ent": ent}

    was_training = model.training
    model.eval()
    try:
        outs = run_schedule(model, mbs, loss_fn, forward_only=True, seq_length=tokens.shape[1])
    finally:
        model.train(was_training)
    shape = (len(mbs) * mbs[0]["tokens"].shape[0], tokens.shape[1] - 1)
    lp = ent = None
    if ps.is_pipeline_last_stage():
        lp = torch.cat([o["lp"] for o in outs])
        ent = torch.cat([o["ent"] for o in outs])
    device = model_device(model)
    lp = broadcast_from_last_stage(lp, shape, torch.float32, device)[:b]
    if with_entropy:
        ent = broadcast_from_last_stage(ent, shape, torch.float32, device)[:b]
        return lp, ent
    return lp, None
