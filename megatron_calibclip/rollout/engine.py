"""Generation from the megatron policy itself, with a KV cache, at any TP/PP.

`RolloutEngine` is the seam: the trainer only calls `generate(prompts, params, seed)` and
gets a RolloutBatch, and `sync_weights()` after each step's updates; vLLM colocated in the
trainer's processes is the other implementation (vllm_engine.py).

`MegatronRolloutEngine` uses megatron-core's StaticInferenceContext (its KV cache): one
prefill over the left-padded prompts, then one token per step, so cost grows linearly
with the response length. With TP the last-position logits are gathered (b x V, small);
with PP each step's hidden state is sent stage to stage. The sampled tokens are chosen on
one rank (last stage, TP rank 0) and broadcast over the model-parallel group, so every rank
holds the same batch. Deterministic for a seed.

When to stop decoding is agreed by all ranks of `stop_group` (default: all ranks), not
decided per rank: a forward can hold collectives over ranks with other prompts (delayed
scaling all-reduces its amax over data-parallel ranks too), so a rank whose sequences all
ended keeps stepping (on padding, results unchanged) until every rank's have.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_calibclip import compat
from megatron_calibclip.parallel.devices import collective_device, model_device
from megatron_calibclip.parallel.flags import any_rank
from megatron_calibclip.rollout.batch import RolloutBatch, check_prompts
from megatron_calibclip.rollout.sampling import SamplingParams, sample_next


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
                 ) -> RolloutBatch: ...

    def sync_weights(self) -> object:
        """Collective, after the policy's weights changed (the trainer calls it after each
        step's updates): an engine with its own copy of the weights reloads it."""
        ...


class MegatronRolloutEngine:
    """KV-cached sampling from a megatron GPTModel stage (this rank's TP shard / PP stage).

    precision: optional factory of a context manager that sets the rollout precision on
    the model for the duration of generation (e.g. FP8 rollout, BF16 trainer).
    stop_group: the ranks that call `generate` together and must run the same number of
    decode steps (None: all ranks); each step costs one 4-byte all-reduce over it.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int, eos_id: int, pad_id: int,
                 precision: Optional[Callable[[], ContextManager]] = None,
                 stop_group: Optional[dist.ProcessGroup] = None,
                 stop_ids: Sequence[int] = ()):
        self.model = model
        self.stop_group = stop_group
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        # every id that ends a response (the tokenizer's stop_ids: the generation config's)
        self.stop_ids = tuple(dict.fromkeys([int(eos_id), *map(int, stop_ids)]))
        self.pad_id = pad_id
        self.precision = precision or contextlib.nullcontext
        self._sampler_rank: Optional[int] = None

    def sync_weights(self) -> None:
        """Nothing to do: this engine decodes with the policy's own parameters."""

    # ---- model-parallel plumbing ---------------------------------------------------------
    def _sampler_global_rank(self) -> int:
        """Global rank of the process that samples: last PP stage, TP rank 0."""
        if self._sampler_rank is None:
            me = dist.get_rank()
            is_sampler = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            group = ps.get_model_parallel_group()
            t = torch.tensor([me if is_sampler else -1], device=collective_device(group))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            self._sampler_rank = int(t.item())
        return self._sampler_rank

    def _forward(self, tokens: torch.Tensor, mask: torch.Tensor, lead: torch.Tensor,
                 ctx: StaticInferenceContext) -> Optional[torch.Tensor]:
        """One pipeline pass; returns last-position logits [b, V_padded] on the last stage.
        A row's positions count from its first real token (`lead` padding columns before
        it), as vLLM's and the trainer's do (trainer/layout.py); padding sits at 0, masked."""
        pp = ps.get_pipeline_model_parallel_world_size()
        b, s = tokens.shape
        positions = (torch.arange(s, device=tokens.device).unsqueeze(0)
                     + ctx.sequence_len_offset - lead.unsqueeze(1)).clamp(min=0)
        if pp > 1 and not ps.is_pipeline_first_stage():
            cfg = self.model.config
            hidden = torch.empty(s, b, cfg.hidden_size, dtype=cfg.pipeline_dtype,
                                 device=tokens.device)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            self.model.set_input_tensor(hidden)
        with compat.inference_mode():  # 0.19 takes its inference paths only under this flag
            out = self.model(tokens, positions, mask, inference_context=ctx,
                             runtime_gather_output=True)
        if pp > 1 and not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        return out[:, -1]

    def _choose(self, logits: Optional[torch.Tensor], params: SamplingParams,
                generator: torch.Generator, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = self._sampler_global_rank()
        # the broadcast payload lives where the model-parallel backend needs it
        packed = torch.zeros(2, b, dtype=torch.float64,
                             device=collective_device(ps.get_model_parallel_group()))
        if dist.get_rank() == src:
            tok, lp = sample_next(logits[:, : self.vocab_size], params, generator)
            packed[0], packed[1] = tok.double(), lp.double()
        if dist.get_world_size(ps.get_model_parallel_group()) > 1:
            dist.broadcast(packed, src=src, group=ps.get_model_parallel_group())
        device = model_device(self.model)
        return packed[0].long().to(device), packed[1].float().to(device)

    def _any_rank_running(self, done: torch.Tensor) -> bool:
        """Collective over `stop_group`: does any rank still have an unfinished sequence?"""
        running = not bool(done.all())
        if not dist.is_initialized() or dist.get_world_size(self.stop_group) == 1:
            return running
        return any_rank(running, self.stop_group)

    # ---- generation ----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
                 ) -> RolloutBatch:
        check_prompts(prompts)
        b = len(prompts)
        width = max(len(p) for p in prompts)
        total = width + params.max_new_tokens
        device = model_device(self.model)
        tokens = torch.full((b, total), self.pad_id, dtype=torch.long, device=device)
        prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
        for i, p in enumerate(prompts):
            tokens[i, width - len(p): width] = torch.tensor(list(p), dtype=torch.long,
                                                            device=device)
        lead = width - prompt_lengths  # left padding per row
        key_pad = torch.arange(total, device=device).unsqueeze(0) < lead.unsqueeze(1)
        logprobs = torch.zeros(b, total - 1, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        # sampling happens on the model's device; torch.multinomial needs its generator there
        generator = torch.Generator(device=device).manual_seed(int(seed))
        ctx = StaticInferenceContext(b, total)
        was_training = self.model.training
        self.model.eval()
        try:
            with self.precision():
                logits = self._forward(tokens[:, :width], key_pad[:, None, None, :width], lead,
                                       ctx)
                ctx.sequence_len_offset += width
                for j in range(params.max_new_tokens):
                    tok, lp = self._choose(logits, params, generator, b)
                    tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
                    col = width + j
                    tokens[:, col] = tok
                    logprobs[:, col - 1] = torch.where(done, torch.zeros_like(lp), lp)
                    lengths += (~done).long()
                    done = done | torch.isin(tok, torch.tensor(self.stop_ids, device=tok.device))
                    if j == params.max_new_tokens - 1 or not self._any_rank_running(done):
                        break
                    logits = self._forward(tokens[:, col: col + 1],
                                           key_pad[:, None, None, : col + 1], lead, ctx)
                    ctx.sequence_len_offset += 1
        finally:
            self.model.train(was_training)
        used = width + int(lengths.max())
        return RolloutBatch(tokens[:, :used].clone(), width, prompt_lengths, lengths, done.clone(),
                            logprobs[:, : used - 1].clone(), self.pad_id)
