"""Host and GPU memory a checkpoint save takes on one rank, per optimizer format.

Why: a save is the run's other memory peak, and it is on the host, which `calibclip plan`
does not otherwise count. What megatron-core does (0.16.1, read in its source):
- the writer (`FileSystemWriterAsync.preload_tensors`) copies every GPU tensor a rank writes to
  host memory before writing; torch's save planner spreads tensors that are replicated over
  DP (weights, the frozen reference, a plain optimizer's state) across the DP ranks that hold
  them, so one rank writes between none and all of them: the bound below is "all";
- `dp_reshardable` (checkpoint/optimizer_format.py) writes each rank's own optimizer shard,
  fp32 main param + Adam m + v (12 B per parameter, / DP), straight from its buffers, with
  each parameter's start padded as the buffer pads it;
- `fully_reshardable` first all-gathers the optimizer state of the whole TP x PP shard into
  host tensors on every DP rank (`get_parameter_state_dp_zero(return_on_all_ranks=True)`:
  12 B per parameter), bucket by bucket through GPU receive buffers (4 B x a bucket's
  elements, x (1 + 1/DP) with the send buffer); its mem-efficient variant gathers over gloo
  onto DP rank 0 only (host, no GPU buffers);
- a plain (non-distributed) optimizer's state is in model space already (12 B per parameter
  with bf16 params: fp32 main + m + v; 8 with fp32 params: m + v), replicated over DP.
tests/planner/test_planner_matches_trainer.py checks `written` against the bytes the trainer's
save writes on each rank at TP=2.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_calibclip.planner.params import StageParams
from megatron_calibclip.planner.spec import Layout
from megatron_calibclip.planner.states import ADAM_BYTES, DTYPE_BYTES, MASTER_AND_ADAM_BYTES

# optimizer.checkpoint_format's values (checkpoint/optimizer_format.py OPTIMIZER_FORMATS, which
# the planner does not import: it needs no megatron; a test holds the two equal)
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable", "fully_reshardable_mem_efficient")
MAIN_AND_ADAM_BYTES = 12  # a distributed optimizer's shard: fp32 main param + Adam m + v
# megatron's DDP bucket with the distributed optimizer (distributed_data_parallel_config.py:
# bucket_size None -> max(40M, 1M x DP) elements); the gather's GPU buffers hold one bucket
BUCKET_ELEMENTS = 40_000_000
PARAM_ALIGNMENT = 64  # param_and_grad_buffer.py: each parameter's start padded to 64 elements


@dataclass(frozen=True)
class SaveMemory:
    format: str  # dp_reshardable | fully_reshardable | fully_reshardable_mem_efficient | plain
    written: float  # tensor bytes one TP x PP shard writes, over its DP ranks together
    staged_host: float  # most host memory one rank's writer stages (GPU tensors it writes)
    gather_host: float  # host tensors of the gathered optimizer state on the worst rank
    gather_gpu: float  # GPU receive/send buffers of that gather (fully_reshardable)

    @property
    def host_peak(self) -> float:
        return self.staged_host + self.gather_host


def optimizer_state_bytes(layout: Layout) -> float:
    """Optimizer bytes per parameter a save writes for one TP x PP shard (all DP ranks)."""
    if layout.distributed_optimizer:
        return MAIN_AND_ADAM_BYTES  # 'param' is saved even where it is the model's fp32 weight
    return MASTER_AND_ADAM_BYTES if layout.params_dtype == "bf16" else ADAM_BYTES


def save_memory(params: StageParams, layout: Layout,
                optimizer_format: str = "dp_reshardable") -> SaveMemory:
    """Bytes of one save on the most loaded rank of the stage `params` describes."""
    p = params.total
    model = (DTYPE_BYTES[layout.params_dtype] + DTYPE_BYTES[layout.reference_dtype]) * p
    state = optimizer_state_bytes(layout) * p
    written = model + state
    if not layout.distributed_optimizer:
        return SaveMemory("plain", written, written, 0.0, 0.0)
    if optimizer_format == "dp_reshardable":
        return SaveMemory(optimizer_format, written, model + state / layout.dp, 0.0, 0.0)
    if optimizer_format == "fully_reshardable":
        bucket = min(p, max(BUCKET_ELEMENTS, 1_000_000 * layout.dp))
        return SaveMemory(optimizer_format, written, model, state,
                          4.0 * bucket * (1 + 1 / layout.dp))
    if optimizer_format == "fully_reshardable_mem_efficient":
        return SaveMemory(optimizer_format, written, model, state, 0.0)
    raise ValueError(f"optimizer format {optimizer_format!r}")


def padding_bound(parameter_tensors: int, layout: Layout) -> float:
    """Most bytes the distributed optimizer's per-parameter alignment adds to `written`."""
    if not layout.distributed_optimizer:
        return 0.0
    return (PARAM_ALIGNMENT - 1) * parameter_tensors * MAIN_AND_ADAM_BYTES
