"""`tools/gpu_check.py`: one prepared run on one GPU (H100/H200) that writes one JSON.

Sections, each independent (a failure is recorded and the others still run):
  a_quantizer           our FP8 codes/scales/GEMMs vs the backend's, K = 4096 and 12288
  b_native_vs_emulated  emulated vs native (`torch._scaled_mm`) FP8 log-probs, same weights
  c_batch_invariance    micro-batch 2 vs 4 log-probs: bf16, tensorwise, blockwise
  d_grpo                GRPO steps of a ~100M random model through the trainer, bf16 and FP8
                        with Calibrated Clipping
  e_throughput          training-step throughput FP8 / BF16 of a 1-3B shape, side by side
`CheckOptions.for_run(device, smoke=True)` shrinks every shape so the same paths run on a CPU.
"""
from megatron_calibclip.bench.gpu_check.options import SECTION_NAMES, CheckOptions, ModelShape
from megatron_calibclip.bench.gpu_check.runner import REPORT_NAME, run_check, write_report

__all__ = ["REPORT_NAME", "SECTION_NAMES", "CheckOptions", "ModelShape", "run_check",
           "write_report"]
