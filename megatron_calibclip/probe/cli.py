"""`calibclip probe fp8-noise`: argument parsing and output files for the probes.

Wiring (cli.py): `from megatron_calibclip.probe.cli import add_probe_parser;
add_probe_parser(sub)` registers `probe` (sub-command `fp8-noise`) with `func=run_probe`.
Standalone: `python -m megatron_calibclip.probe.cli fp8-noise --model tiny`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from err


def add_probe_parser(subparsers) -> argparse.ArgumentParser:
    """Register `probe` with its sub-command `fp8-noise` on an argparse subparsers object."""
    from megatron_calibclip.probe.fp8_noise import GRANULARITIES, ProbeConfig

    d = ProbeConfig()
    p = subparsers.add_parser("probe", help="measurement probes: fp8-noise",
                              description="Measurement probes. See docs/fp8-noise.md.")
    sub = p.add_subparsers(dest="probe_command", required=True)
    f = sub.add_parser(
        "fp8-noise", help="FP8 vs BF16 vs fp32 log-prob error, ratio noise and phantom clipping "
                          "per FP8 recipe",
        description="Per-token |logp_fp8 - logp_bf16| by token probability, and the PPO-ratio "
                    "noise of each source (micro-batch layout; one small update) with the "
                    "phantom-clip rate, for every recipe side by side (fp32 = truth). Writes "
                    "fp8_noise.json and fp8_noise.png to --out. Single process (TP=1).")
    f.add_argument("--model", default=d.model,
                   help="model preset with random weights (tiny, smollm2-135m, ...); with --load "
                        "only a label (the architecture comes from the folder)")
    f.add_argument("--load", default=None, metavar="HF_DIR",
                   help="Hugging Face folder (config.json + safetensors) to load the weights from")
    f.add_argument("--recipe", action="append", default=None,
                   help=f"FP8 granularity to compare: {', '.join(GRANULARITIES)} or all "
                        f"(repeatable or comma-separated; default all)")
    f.add_argument("--tokens", choices=("chain_sum", "samples", "random"), default=d.tokens,
                   help="chain_sum: question + answer text, all positions; samples: chain_sum "
                        "questions + responses sampled from the model, response tokens only; "
                        "random: uniform ids (byte tokens, or the folder's tokenizer with --load)")
    f.add_argument("--sample-len", type=int, default=d.sample_len,
                   help="samples: response length limit (tokens)")
    f.add_argument("--temperature", type=float, default=d.temperature,
                   help="samples: sampling temperature")
    f.add_argument("--num-seqs", type=int, default=d.num_seqs, help="sequences in the batch")
    f.add_argument("--max-len", type=int, default=d.max_len, help="longest sequence (tokens)")
    f.add_argument("--corrupt", type=float, default=d.corrupt,
                   help="chain_sum: fraction of positions replaced by random ids (low-probability "
                        "tokens)")
    f.add_argument("--old-micro-batch", type=int, default=d.old_micro_batch,
                   help="micro-batch size of the old log-probs (layout A, in order)")
    f.add_argument("--micro-batch", type=int, default=d.micro_batch,
                   help="micro-batch size of the current log-probs (layout B, shuffled)")
    f.add_argument("--lrs", type=_floats, default=d.lrs,
                   help="learning rates of the one-step updates (comma-separated)")
    f.add_argument("--eps-low", type=float, default=d.eps_low, help="PPO lower clip epsilon")
    f.add_argument("--eps-high", type=float, default=d.eps_high, help="PPO upper clip epsilon")
    f.add_argument("--neg-frac", type=float, default=d.neg_frac,
                   help="fraction of sequences with advantage -1 (others +1)")
    f.add_argument("--warmup-steps", type=int, default=None,
                   help="supervised fp32 warm-up steps before probing (default: 60 for a "
                        "random-weight model of <= 10M parameters, else 0)")
    f.add_argument("--warmup-lr", type=float, default=d.warmup_lr, help="warm-up Adam lr")
    f.add_argument("--break-bf16-ties", type=int, default=None, metavar="SEED",
                   help="with --load: randomly break exact bf16 rounding ties in the weights")
    f.add_argument("--dither-weights", type=int, default=None, metavar="SEED",
                   help="move linear weights lying exactly on a bf16 or E4M3 (power-of-two "
                        "scale) rounding tie by a seeded amount below half a bf16 step, "
                        "keeping every bf16 value (recommended with --load)")
    f.add_argument("--seed", type=int, default=d.seed, help="seed of weights, data, advantages")
    f.add_argument("--emulation", choices=("bf16_stack", "bf16_weights", "gemm_only"),
                   default=d.emulation,
                   help="bf16_stack (default: bf16 model copy + bf16 activations, as on GPU), "
                        "bf16_weights (fp32 activations), gemm_only (the earlier emulation)")
    f.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for a preset of <= 10M parameters, "
                        "which is fastest on a shared machine; else torch's default)")
    f.add_argument("--out", default="fp8-noise", help="output folder (created)")
    f.add_argument("--no-plot", action="store_true", help="skip the PNG")
    f.set_defaults(func=run_probe)
    p.set_defaults(func=run_probe)
    return p


def _config(args: argparse.Namespace):
    from megatron_calibclip.probe.fp8_noise import ProbeConfig, parse_recipes

    return ProbeConfig(
        model=args.model, load=args.load,
        recipes=parse_recipes(args.recipe if args.recipe else "all"),
        tokens=args.tokens, num_seqs=args.num_seqs, max_len=args.max_len, corrupt=args.corrupt,
        sample_len=args.sample_len, temperature=args.temperature,
        old_micro_batch=args.old_micro_batch, micro_batch=args.micro_batch, lrs=args.lrs,
        eps_low=args.eps_low, eps_high=args.eps_high, neg_frac=args.neg_frac,
        warmup_steps=args.warmup_steps, warmup_lr=args.warmup_lr,
        break_bf16_ties=args.break_bf16_ties, dither_weights=args.dither_weights,
        seed=args.seed, emulation=args.emulation)


def _fmt(v: Optional[float], spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """A compact text table of the result (what the command prints)."""
    recipes = result["config"]["recipes"]
    sources = list(result["sources"])
    labels = result["prob_buckets"]["labels"]
    lines = [f"tokens: {result['data']['num_tokens']} ({result['data']['num_neg_tokens']} with "
             f"A<0); per probability bucket {labels}: {result['prob_buckets']['count']}",
             "mean |dlogp| per bucket (FP8 vs BF16; bf16 row: vs fp32):"]
    lines.append(f"  {'bf16':<11} " + " ".join(
        f"{_fmt(v):>9}" for v in result["static"]["bf16"]["vs_fp32"]["mean"]))
    for r in recipes:
        lines.append(f"  {r:<11} " + " ".join(
            f"{_fmt(v):>9}" for v in result["static"][r]["vs_bf16"]["mean"]))
    lines.append("log-ratio noise std vs fp32 | phantom clips vs BF16 (bf16 row: vs fp32), per "
                 f"source {sources}:")
    for k in ["bf16"] + list(recipes):
        std = " ".join(f"{_fmt(result['sources'][s][k]['noise_std_vs_fp32']):>9}"
                       for s in sources)
        m = "phantom_vs_fp32" if k == "bf16" else "phantom_vs_bf16"
        ph = " ".join(f"{_fmt(result['sources'][s][k][m], '.2%'):>7}" for s in sources)
        lines.append(f"  {k:<11} {std} | {ph}")
    return lines


def run_probe(args: argparse.Namespace) -> int:
    """Entry point of `calibclip probe ...`; returns the exit status."""
    if getattr(args, "probe_command", None) != "fp8-noise":
        print(f"calibclip probe: unknown probe {getattr(args, 'probe_command', None)!r}",
              file=sys.stderr)
        return 2
    from megatron_calibclip.probe.fp8_noise import ProbeError, run_fp8_noise

    try:
        cfg = _config(args)
    except ProbeError as err:
        print(f"calibclip probe fp8-noise: {err}", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    from megatron_calibclip.parallel import (
        ParallelLayout,
        initialize_distributed,
        initialize_model_parallel,
        teardown,
        teardown_model_parallel,
    )

    threads = args.threads
    if threads is None and cfg.load is None:
        from megatron_calibclip.models import get_preset
        from megatron_calibclip.probe.fp8_noise import SMALL_MODEL_PARAMS

        if get_preset(cfg.model).num_parameters() <= SMALL_MODEL_PARAMS:
            threads = 1
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    started = not dist.is_initialized()
    if started:  # a 1-rank gloo world (or whatever torchrun/SLURM describes)
        initialize_distributed(ParallelLayout())
    else:
        initialize_model_parallel(ParallelLayout())
    rank0 = dist.get_rank() == 0
    log = print if rank0 else (lambda _msg: None)
    try:
        result = run_fp8_noise(cfg, log=log)
    except (ProbeError, OSError) as err:
        print(f"calibclip probe fp8-noise: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - conversion errors of a bad --load folder
        if type(err).__name__ in ("ConversionError", "TokenizerError", "DataError"):
            print(f"calibclip probe fp8-noise: {err}", file=sys.stderr)
            return 2
        raise
    finally:
        teardown() if started else teardown_model_parallel()
    if rank0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_noise.json").write_text(json.dumps(result, indent=1) + "\n")
        for line in summary_lines(result):
            print(line)
        print(f"wrote {out / 'fp8_noise.json'}")
        if not args.no_plot:
            from megatron_calibclip.probe.plot import plot_fp8_noise

            print(f"wrote {plot_fp8_noise(result, out / 'fp8_noise.png')}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="calibclip")
    add_probe_parser(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["probe"]:
        argv = ["probe"] + argv
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
