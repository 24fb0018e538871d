"""FP8 code -> BF16 operand conversion on the CPU: torch's `.to(torch.bfloat16)` vs the
256-entry table gather (`fp8.formats.codes_to_bf16`), side by side in one run; prints JSON.

Two measurements, interleaved round-robin (load from other processes hits both alike):
  * the conversion alone, on a [2048, 576] E4M3 tensor (a SmolLM2 activation operand);
  * SmolLM2-135M forward+backward in FP8 (hybrid, tensorwise, native GEMM path, TP=1, one
    process), batch x seq as the reproduction's update micro-batch, with the table or with
    `.to` patched back in. Also checks that the log-probs are bit-identical between the two.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/bench_code_conversion.py [--rounds N]
"""
from __future__ import annotations

import argparse
import json
import warnings

import torch

warnings.filterwarnings("ignore")

from megatron_calibclip.bench.timing import interleaved_times  # noqa: E402
from megatron_calibclip.fp8 import FP8Recipe, native, set_precision  # noqa: E402
from megatron_calibclip.fp8.formats import codes_to_bf16  # noqa: E402
from megatron_calibclip.models import build_policy_model, emulated_layer_spec, get_preset  # noqa: E402
from megatron_calibclip.parallel import (  # noqa: E402
    initialize_distributed,
    model_parallel,
    vocab_parallel_logprobs_entropy,
)


def _with_conversion(convert):
    """Run a callable with native.codes_to_bf16 replaced by `convert`."""
    def wrap(fn):
        def run():
            saved = native.codes_to_bf16
            native.codes_to_bf16 = convert
            try:
                return fn()
            finally:
                native.codes_to_bf16 = saved
        return run
    return wrap


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=41)
    args = p.parse_args()
    torch.manual_seed(0)
    codes = (torch.randn(2048, 576) * 3).to(torch.float8_e4m3fn)
    alone = interleaved_times({"to_bf16": lambda: codes.to(torch.bfloat16),
                          "table": lambda: codes_to_bf16(codes)}, rounds=20)
    torch_to = lambda c: c.to(torch.bfloat16)  # noqa: E731
    initialize_distributed()  # single process (gloo); megatron needs its groups
    with model_parallel(tp=1):
        cfg = get_preset("smollm2-135m")
        model = build_policy_model(cfg, spec=emulated_layer_spec(cfg), seed=0)
        set_precision(model, "fp8", FP8Recipe(format="hybrid", granularity="tensorwise"))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(1, cfg.vocab_size, (args.batch, args.seq), generator=g)
        pos = torch.arange(args.seq).expand(args.batch, -1)

        def logp():
            logits = model(tokens, pos, None)
            return vocab_parallel_logprobs_entropy(logits[:, :-1], tokens[:, 1:],
                                                   true_vocab_size=cfg.vocab_size)[0]

        def fwd_bwd():
            model.zero_grad()
            (-logp().mean()).backward()

        with torch.no_grad():
            a = _with_conversion(torch_to)(logp)()
            b = logp()
        step = interleaved_times({"to_bf16": _with_conversion(torch_to)(fwd_bwd), "table": fwd_bwd},
                            rounds=args.rounds)
    out = {
        "threads": torch.get_num_threads(),
        "conversion_2048x576": alone,
        "conversion_speedup_min": alone["to_bf16"]["min_s"] / alone["table"]["min_s"],
        "smollm2_fp8_fwd_bwd": {"batch": args.batch, "seq": args.seq, **step},
        "fwd_bwd_speedup_min": step["to_bf16"]["min_s"] / step["table"]["min_s"],
        "fwd_bwd_speedup_median": step["to_bf16"]["median_s"] / step["table"]["median_s"],
        "logprobs_bit_identical": bool(torch.equal(a.view(torch.int32), b.view(torch.int32))),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
