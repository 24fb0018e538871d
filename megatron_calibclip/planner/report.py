"""Plain-text tables of estimates (what `calibclip plan` prints) and a JSON form.

Why separate from the arithmetic: the numbers are tested on their own; formatting changes
must not touch them.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Optional

from megatron_calibclip.models.config import ModelConfig
from megatron_calibclip.planner.memory import Estimate, estimate
from megatron_calibclip.planner.params import stage_params
from megatron_calibclip.planner.save import OPTIMIZER_FORMATS, SaveMemory, save_memory
from megatron_calibclip.planner.spec import GIB
from megatron_calibclip.planner.states import DTYPE_BYTES


def gib(x: float) -> str:
    return f"{x / GIB:6.1f}"


def layout_row(e: Estimate) -> str:
    lay, s = e.layout, e.worst
    return (f"{lay.tp:>3} {lay.pp:>3} {lay.dp:>4}  {'yes' if lay.sp else 'no':>3}  "
            f"{'on' if lay.distributed_optimizer else 'off':>4}  {lay.recompute:<9} "
            f"{'offload' if lay.offload_reference else 'GPU':<8}"
            f"{gib(s.static)} {gib(s.update)} {gib(s.logprobs)} {gib(s.generation)} "
            f"{gib(e.peak)} {e.headroom_gib:7.1f}  {s.peak_phase} (stage {s.stage})")


HEADER = (" TP  PP   DP   SP  dopt  recompute ref      states update logprb    gen   peak "
          "  spare  peak phase\n" + "-" * 112)


def table(estimates: list[Estimate], limit: int | None = None) -> str:
    rows = [layout_row(e) for e in estimates[:limit]]
    return "\n".join([HEADER, *rows])


def breakdown(m: ModelConfig, e: Estimate) -> str:
    """The recommended layout in detail, with the alternatives the issue asks about."""
    s, lay, w = e.worst, e.layout, e.workload
    st = s.states
    alt_opt = estimate(m, replace(lay, distributed_optimizer=not lay.distributed_optimizer),
                       w, e.hardware).worst.states.optimizer if lay.dp > 1 else st.optimizer
    def row(label: str, value: float, note: str = "") -> str:
        return f"  {label:<44}{value / GIB:6.1f} GiB{'  ' + note if note else ''}"

    def update_with(r: str) -> float:
        return estimate(m, replace(lay, recompute=r), w, e.hardware).stages[s.stage].update

    recompute = ", ".join(f"{r} {update_with(r) / GIB:.1f}"
                          for r in ("none", "selective", "full"))
    lines = [
        f"{e.model}: {lay.describe()}, {lay.precision.upper()} GEMMs",
        f"  most loaded GPU: pipeline stage {s.stage} of {lay.pp} ({s.layers} layers, "
        f"{s.params / 1e9:.2f}B parameters)",
        row(f"policy weights ({lay.params_dtype})", st.weights),
        row("FP8 weight + transpose caches", st.fp8_caches),
        row(f"gradient buffer ({lay.grad_dtype})", st.grads),
        row("optimizer (FP32 master + Adam m, v)" if lay.params_dtype == "bf16"
            else "optimizer (Adam m, v)", st.optimizer,
            f"distributed optimizer {'on' if lay.distributed_optimizer else 'off'}; "
            f"{'off' if lay.distributed_optimizer else 'on'}: {alt_opt / GIB:.1f} GiB"),
        row(f"reference model ({lay.reference_dtype})", DTYPE_BYTES[lay.reference_dtype] * s.params,
            "offloaded: on the GPU only for its log-prob pass" if lay.offload_reference
            else "resident"),
        row(f"update activations (mb {w.micro_batch}, seq {w.seq_len})", s.update,
            f"recompute {recompute} GiB"),
        row(f"log-prob pass (mb {w.logprob_micro_batch})", s.logprobs),
        *((row(f"vLLM engine weights (all layers / TP {lay.tp})", s.engine_weights),
           row(f"vLLM KV cache needed ({w.rollout_batch} seqs / PP {lay.pp} x {w.seq_len})",
               s.kv_cache),
           row(f"generation: vLLM's share ({lay.engine_memory_fraction:g} of the GPU)",
               s.generation, ("fits" if s.engine_fits else "TOO SMALL for weights + KV")
               + (", released outside generation (sleep)" if lay.engine_sleeps
                  else ", resident in every phase")))
          if lay.rollout_engine == "vllm" else
          (row(f"rollout KV cache ({w.rollout_batch} seqs x {w.seq_len}, {lay.kv_cache_dtype})",
               s.kv_cache),
           row("generation (KV cache + prefill, logits)", s.generation))),
        *_save_rows(m, e, row),
        f"  peak {e.peak_gib:.1f} GiB in the {s.peak_phase} phase + "
        f"{e.hardware.reserve_gib:.1f} GiB reserve of {e.hardware.gpu_memory_gib:.1f} GiB: "
        + (f"fits, {e.headroom_gib:.1f} GiB spare" if e.fits
           else f"does NOT fit ({-e.headroom_gib:.1f} GiB short)"),
    ]
    return "\n".join(lines)


def _save(m: ModelConfig, e: Estimate, fmt: Optional[str] = None) -> SaveMemory:
    lay = e.layout
    return save_memory(stage_params(m, lay.tp, lay.pp, e.worst.stage), lay,
                       fmt or lay.optimizer_format)


def _save_rows(m: ModelConfig, e: Estimate, row) -> list[str]:
    """A checkpoint save's memory on the most loaded rank, and the other formats'."""
    save = _save(m, e)
    others = ""
    if e.layout.distributed_optimizer:
        others = "; " + ", ".join(
            f"{f}: {_save(m, e, f).host_peak / GIB:.1f}" for f in OPTIMIZER_FORMATS
            if f != save.format) + " GiB"
    return [row(f"checkpoint save, host ({save.format})", save.host_peak,
                f"staged {save.staged_host / GIB:.1f} + gathered {save.gather_host / GIB:.1f}"
                + others),
            row("checkpoint save, GPU beyond the states", save.gather_gpu,
                "the optimizer gather's buffers" if save.gather_gpu else "no gather")]


def to_json(e: Estimate, m: Optional[ModelConfig] = None) -> dict[str, Any]:
    """The estimate as JSON; with the model config `m`, the checkpoint save's bytes too."""
    s = e.worst
    save = {} if m is None else {"save": {**asdict(_save(m, e)),
                                          "host_peak_gib": _save(m, e).host_peak / GIB}}
    return {"model": e.model, "layout": asdict(e.layout), "workload": asdict(e.workload),
            "fits": e.fits, "peak_gib": round(e.peak_gib, 3),
            "headroom_gib": round(e.headroom_gib, 3), "peak_phase": s.peak_phase,
            "worst_stage": s.stage,
            "stages": [{"stage": x.stage, "layers": x.layers, "params": x.params,
                        "weights_gib": x.states.weights / GIB,
                        "fp8_caches_gib": x.states.fp8_caches / GIB,
                        "grads_gib": x.states.grads / GIB,
                        "optimizer_gib": x.states.optimizer / GIB,
                        "reference_gib": x.states.reference / GIB,
                        "update_gib": x.update / GIB, "logprobs_gib": x.logprobs / GIB,
                        "generation_gib": x.generation / GIB, "kv_cache_gib": x.kv_cache / GIB,
                        "engine_weights_gib": x.engine_weights / GIB,
                        "engine_share_gib": x.engine_share / GIB, "engine_fits": x.engine_fits,
                        "peak_gib": x.peak / GIB} for x in e.stages], **save}
