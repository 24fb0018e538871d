"""Peak memory of one GPU over the three phases of an RL step, for every pipeline stage.

Why phases: an RL step generates (KV cache), computes log-probs (forward only: old policy,
BF16 reference, BF16 shadow pass on calibration steps) and trains (activations kept for
backward). These never overlap, while the model states (policy weights, FP8 caches,
gradient buffer, optimizer states, a resident reference) stay for the whole run. So
peak = states + max(generation, log-probs, update), on the most loaded stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.planner import activations as act
from megatron_calibclip.planner.engine import engine_need, engine_share
from megatron_calibclip.planner.params import check_layout, stage_params
from megatron_calibclip.planner.rollout import kv_cache_bytes, prefill_logits_bytes
from megatron_calibclip.planner.spec import GIB, Hardware, Layout, Workload
from megatron_calibclip.planner.states import DTYPE_BYTES, ModelStates, model_states


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    params: int  # parameters on one GPU of this stage
    states: ModelStates
    update: float  # activations kept for backward (+ output layer, logits on the last stage)
    logprobs: float  # forward-only transients (+ reference weights brought in if offloaded)
    generation: float  # KV cache + prefill transients and logits (vllm: the engine's share)
    kv_cache: float  # the KV cache alone (part of generation)
    engine_weights: float = 0.0  # vllm: the engine's weights on this GPU (inside its share)
    engine_share: float = 0.0  # vllm: what vLLM reserves (0 with the megatron engine)

    @property
    def engine_fits(self) -> bool:
        """vllm: the engine's weights and KV cache fit in its share (megatron: True)."""
        return not self.engine_share or self.engine_weights + self.kv_cache <= self.engine_share

    @property
    def static(self) -> float:
        return self.states.policy + self.states.reference

    @property
    def phase_peaks(self) -> dict[str, float]:
        return {"generation": self.static + self.generation,
                "log-probs": self.static + self.logprobs,
                "update": self.static + self.update}

    @property
    def peak(self) -> float:
        return max(self.phase_peaks.values())

    @property
    def peak_phase(self) -> str:
        peaks = self.phase_peaks
        return max(peaks, key=peaks.get)


@dataclass(frozen=True)
class Estimate:
    model: str
    layout: Layout
    workload: Workload
    hardware: Hardware
    stages: list[StageMemory] = field(default_factory=list)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def peak(self) -> float:
        return self.worst.peak

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB

    @property
    def headroom_gib(self) -> float:
        """Memory left after the peak and the reserve (negative: does not fit)."""
        return (self.hardware.usable_bytes - self.peak) / GIB

    @property
    def fits(self) -> bool:
        return self.headroom_gib >= 0 and all(s.engine_fits for s in self.stages)


def _stage(m: ModelConfig, layout: Layout, w: Workload, stage: int,
           hw: Hardware = Hardware()) -> StageMemory:
    sp_ = stage_params(m, layout.tp, layout.pp, stage)
    states = model_states(sp_, layout, reference_resident=not layout.offload_reference)
    layer = act.for_model(m, layout.precision)
    tp, sp, last = layout.tp, layout.sp, stage == layout.pp - 1
    n = act.in_flight_microbatches(layout.pp, stage, w.microbatches_per_step)
    kept = sp_.layers * layer.bytes(w.seq_len, w.micro_batch, tp, sp, layout.recompute) * n
    if layout.recompute == "full":  # one layer is rebuilt at a time during backward
        kept += layer.bytes(w.seq_len, w.micro_batch, tp, sp, "none")
    if last:
        kept += act.output_bytes(m, w.seq_len, w.micro_batch, tp, sp)
    # forward only: one layer's tensors at a time, then the logits of the micro-batch
    fwd = layer.bytes(w.seq_len, w.logprob_micro_batch, tp, sp, "none")
    if last:
        fwd += act.output_bytes(m, w.seq_len, w.logprob_micro_batch, tp, sp)
    if layout.offload_reference:
        # the reference comes back for its own log-prob pass
        fwd += DTYPE_BYTES[layout.reference_dtype] * sp_.total
    if layout.rollout_engine == "vllm":
        weights, kv = engine_need(m, layout, w)
        share = engine_share(layout, hw)
        if not layout.engine_sleeps:  # resident in every phase
            kept, fwd = kept + share, fwd + share
        return StageMemory(stage, sp_.layers, sp_.total, states, kept, fwd, share, kv,
                           weights, share)
    kv = kv_cache_bytes(m, sp_.layers, tp, w.rollout_batch, w.seq_len,
                        DTYPE_BYTES[layout.kv_cache_dtype])
    gen = kv + layer.bytes(w.prompt_len, w.rollout_batch, tp, sp, "none")
    if last:
        gen += prefill_logits_bytes(m, tp, w.rollout_batch, w.prompt_len)
    return StageMemory(stage, sp_.layers, sp_.total, states, kept, fwd, gen, kv)


def estimate(m: ModelConfig, layout: Layout, workload: Workload,
             hardware: Hardware = Hardware(), name: str = "") -> Estimate:
    """Per-GPU memory of every pipeline stage; ValueError for a layout Megatron rejects."""
    problem = check_layout(m, layout.tp, layout.pp)
    if problem:
        raise ValueError(problem)
    stages = [_stage(m, layout, workload, s, hardware) for s in range(layout.pp)]
    return Estimate(name, layout, workload, hardware, stages)
