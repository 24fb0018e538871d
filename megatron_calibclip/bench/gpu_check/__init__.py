"""`tools/gpu_check.py`: one prepared run on one GPU (H100/H200) that writes one JSON.

Sections, each independent (a failure is recorded and the others still run); each names its
`reference` and records, per case, whether it `ran`:
  a_quantizer           our FP8 codes/scales and the `torch` backend's GEMMs, K = 4096 and
                        12288: GEMMs vs the float64 product of the original operands within
                        the derived e4m3 noise; codes/scales vs TE's quantizers bit for bit
  b_native_vs_emulated  emulated vs native (`torch._scaled_mm`) FP8, same weights: log-probs,
                        and backward in the hybrid format (input and weight gradients of the
                        model; output, dgrad, wgrad of one linear)
  c_batch_invariance    micro-batch 2 vs 4 log-probs through the trainer's path, on the
                        model the trainer builds here: bf16, tensorwise, blockwise
  f_te_vs_emulation     megatron's TE spec vs our emulated spec on the same weights: FP8
                        log-probs per TE recipe, and one TE linear vs ours (fwd + bwd);
                        left-padded rows vs each row alone on TE's attention (padding)
  e_throughput          training-step throughput FP8 / BF16 of a 1-3B shape, side by side
  d_grpo                GRPO steps of a ~100M random model through the trainer, bf16 and FP8
                        with Calibrated Clipping; rollout vs trainer log-probs bounded
Every model is built with the trainer's builders (models.build_policy_model with the layer
spec the trainer would take, its params dtype, models.place_on_device). A case that did not
run fails (verdict.py), except a CPU limitation in a `--smoke` run on the CPU, listed in the
report's "not_run", or a recipe this GPU's compute capability lacks.
`CheckOptions.for_run(device, smoke=True)` shrinks every shape so the same paths run on a CPU.
"""
from megatron_calibclip.bench.gpu_check.options import SECTION_NAMES, CheckOptions, ModelShape
from megatron_calibclip.bench.gpu_check.runner import REPORT_NAME, run_check, write_report

__all__ = ["REPORT_NAME", "SECTION_NAMES", "CheckOptions", "ModelShape", "run_check",
           "write_report"]
