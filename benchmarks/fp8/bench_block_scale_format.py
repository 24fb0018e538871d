"""What a mismatch of FP8 block-scale formats between rollout and trainer costs; prints JSON.

Why (issue 37, finding 10): vLLM's online `fp8_per_block` quantization takes fp32 scales
(amax / 448: vllm/utils/deep_gemm.py per_block_cast_to_fp8, use_ue8m0=False; activations by
per-token-group quantization with fp32 scales on Hopper), while Transformer Engine's blockwise
recipe defaults to power-of-two scales (Float8BlockScaling, unless the job starts with
NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1). With FP8 on both sides that difference alone moves
pi_old away from pi_rollout. Measured here with our bit-exact emulation of both formats on
the same weights and tokens (SmolLM2-135M-Instruct by default, real weights), side by side:
  * scale_mismatch: blockwise FP8 with power-of-two scales vs with fp32 scales (what a TE
    trainer on its default would compute against a vLLM rollout);
  * fp8_effect: blockwise FP8 (fp32 scales) vs BF16 (the noise FP8 itself adds);
each as mean / max |delta log p| over the tokens and as loss/mult_prob_error's statistic,
mean exp|delta log p|. Emulation isolates the scale format: on a GPU the two engines'
kernels add their own differences on top.

    .venv/bin/python benchmarks/fp8/bench_block_scale_format.py \
        [--checkpoint checkpoints/smollm2-135m-mcore] [--tokenizer checkpoints/smollm2-135m-hf]
"""
from __future__ import annotations

import argparse
import json
import platform
import warnings

import torch

warnings.filterwarnings("ignore")

PROMPTS = [  # chat-formatted arithmetic and prose, as the reproduction's rollouts look
    "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\nThe answer is 12.",
    "<|im_start|>user\nCompute 3 + 9 and explain.<|im_end|>\n<|im_start|>assistant\n3 plus 9 "
    "is 12, because adding 9 is adding 10 and taking away 1.",
    "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\nThe "
    "sea is wide and grey in winter, and it smells of salt and rain.",
    "<|im_start|>user\nList three primes.<|im_end|>\n<|im_start|>assistant\n2, 3 and 5 are "
    "prime numbers; 7 is the next one.",
]


def _stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a - b).abs().double()
    return {"mean_abs": d.mean().item(), "max_abs": d.max().item(),
            "mult_prob_error": d.exp().mean().item()}


def _logprobs(model, cfg, rows: list[torch.Tensor]) -> torch.Tensor:
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    out = []
    for r in rows:  # one row at a time: no padding, no neighbour in any scale
        t = r[None]
        mask = torch.zeros(1, 1, 1, t.shape[1], dtype=torch.bool)
        out.append(shifted_logprobs_entropy(forward_logits(model, t, mask), t,
                                            cfg.vocab_size)[0][0])
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="checkpoints/smollm2-135m-mcore")
    parser.add_argument("--tokenizer", default="checkpoints/smollm2-135m-hf")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from megatron_calibclip.checkpoint import CheckpointInfo, load_weights
    from megatron_calibclip.checkpoint.layout import resolve_checkpoint
    from megatron_calibclip.fp8 import FP8Recipe, reset_fp8_state, set_precision
    from megatron_calibclip.models import build_policy_model
    from megatron_calibclip.models.layer_specs import emulated_layer_spec
    from megatron_calibclip.parallel import initialize_distributed

    initialize_distributed()
    cfg = CheckpointInfo.read(resolve_checkpoint(args.checkpoint)).model()
    model = build_policy_model(cfg, spec=emulated_layer_spec(cfg), initialize=False)
    load_weights(args.checkpoint, model)
    model.eval()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    rows = [torch.tensor(tok(p)["input_ids"]) for p in PROMPTS]
    lp = {}
    with torch.no_grad():
        set_precision(model, "bf16")
        lp["bf16"] = _logprobs(model, cfg, rows)
        for name, pow2 in (("fp8_pow2_scales", True), ("fp8_fp32_scales", False)):
            set_precision(model, "fp8", FP8Recipe(format="hybrid", granularity="blockwise",
                                                  power_of_two_scales=pow2))
            reset_fp8_state(model)
            lp[name] = _logprobs(model, cfg, rows)
    mismatch = _stats(lp["fp8_pow2_scales"], lp["fp8_fp32_scales"])
    effect = _stats(lp["fp8_fp32_scales"], lp["bf16"])
    print(json.dumps({
        "benchmark": "block_scale_format", "checkpoint": args.checkpoint,
        "model_parameters": cfg.num_parameters(), "tokens": int(lp["bf16"].numel()),
        "recipe": "hybrid blockwise (1x128 activations, 128x128 weights), emulated",
        "scale_mismatch_pow2_vs_fp32": mismatch, "fp8_effect_fp32_scales_vs_bf16": effect,
        "mismatch_over_fp8_effect": mismatch["mean_abs"] / effect["mean_abs"],
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
