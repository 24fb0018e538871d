"""`calibclip`: the command line (the only module that parses command lines).

Subcommands grow with the product: `info` and `presets` now; `train`, `convert`, `plan`,
`calibrate`, `report` as their issues land.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _cmd_info(args: argparse.Namespace) -> int:
    import torch

    import megatron_calibclip
    from megatron_calibclip import patches

    from megatron_calibclip import compat

    # the release from the package metadata: 0.19's `megatron.core.__version__` appends the git
    # commit of any repository its files sit in (a venv inside a clone: "0.19.2+c5395fd")
    version = compat.megatron_version()
    print(f"megatron-calibclip {megatron_calibclip.__version__}")
    print(f"torch {torch.__version__} (CUDA available: {torch.cuda.is_available()})")
    print(f"megatron-core {version}: {compat.line_status()} (supported lines: "
          f"{compat.supported_lines_text()}; CPU patch table {patches.MADE_FOR_MEGATRON_CORE})")
    from megatron_calibclip.fp8.te_install import describe

    print(f"transformer-engine: {describe()}")
    print(f"CPU patches for megatron-core: "
          f"{'needed' if patches.cpu_patches_needed() else 'not needed (CUDA)'}")
    from megatron_calibclip.fp8.backend import resolve_backend

    backend, why = resolve_backend("auto")
    print(f"FP8 backend for fp8.backend=auto: {backend} ({why[len('auto: '):]})")
    from megatron_calibclip.fp8.gemm import gemm_path_and_why

    path, why = gemm_path_and_why()
    print(f"GEMM path of our linears: {path} ({why}; CALIBCLIP_GEMM=auto|native|exact|fp32, "
          "fp8/README.md)")
    return 0


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _cmd_presets(args: argparse.Namespace) -> int:
    from megatron_calibclip.models import PRESETS

    print(f"{'preset':<14} {'family':<6} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} "
          f"{'head_dim':>8} {'ffn':>6} {'vocab':>7} {'tied':>5} {'params':>9}")
    for name, c in PRESETS.items():
        print(f"{name:<14} {c.family:<6} {c.num_layers:>6} {c.hidden_size:>6} "
              f"{c.num_attention_heads:>5} {c.num_query_groups:>3} {c.head_dim:>8} "
              f"{c.ffn_hidden_size:>6} {c.vocab_size:>7} {str(c.tie_embeddings):>5} "
              f"{_human(c.num_parameters()):>9}")
    return 0


def load_train_config(path: str, overrides: Sequence[str]):
    """trainer.config.load_train_config (imported lazily: `calibclip --help` stays fast)."""
    from megatron_calibclip.trainer.config import load_train_config as load

    return load(path, overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    from megatron_calibclip.config import ConfigError

    try:
        cfg = load_train_config(args.config, args.set or [])
    except ConfigError as err:
        print(f"calibclip train: invalid configuration: {err}", file=sys.stderr)
        return 2
    import os

    from megatron_calibclip.checkpoint.errors import CheckpointError
    from megatron_calibclip.data import DataError
    from megatron_calibclip.parallel import ParallelLayoutError
    from megatron_calibclip.trainer.loop import main_train
    from megatron_calibclip.trainer.run_dir import RunDirError

    try:
        return main_train(cfg)
    except ParallelLayoutError as err:  # e.g. TP=2 started as one plain process
        print(f"calibclip train: {err}. {launch_hint(cfg.parallel.tp * cfg.parallel.pp, args)}",
              file=sys.stderr)
        return 2
    except (RunDirError, DataError, CheckpointError, ConfigError) as err:  # on every rank: one line
        if os.environ.get("RANK", "0") == "0":
            print(f"calibclip train: {err}", file=sys.stderr)
        return 2


def _cmd_te_env(args: argparse.Namespace) -> int:
    """NAME=VALUE lines: the variables Transformer Engine must find when it is imported for
    this config's FP8 recipes (fp8/te.py te_environment). Why a command: TE reads them once,
    at import, and megatron-core imports TE before our code runs, so the launcher must export
    them (launch/train.sbatch)."""
    from megatron_calibclip.config import ConfigError
    from megatron_calibclip.fp8 import FP8Recipe, te_environment
    from megatron_calibclip.trainer.config import load_raw_config

    try:
        raw = load_raw_config(args.config, args.set or [])
        trainer = FP8Recipe.from_dict(raw.get("fp8") or {})
        rollout_section = (raw.get("rollout") or {}).get("fp8")
        rollout = FP8Recipe.from_dict(rollout_section) if rollout_section else trainer
    except ConfigError as err:
        print(f"calibclip te-env: invalid configuration: {err}", file=sys.stderr)
        return 2
    env: dict[str, str] = {}
    if raw.get("precision", "bf16") == "fp8":
        env.update(te_environment(trainer))
    if (raw.get("rollout") or {}).get("precision") == "fp8":
        env.update(te_environment(rollout))
    for name, value in sorted(env.items()):
        print(f"{name}={value}")
    return 0


def launch_hint(ranks: int, args: argparse.Namespace) -> str:
    """How to start `ranks` processes for this command line (torchrun, srun, launch/local.sh)."""
    sets = " ".join(f"--set {s}" for s in (args.set or []))
    tail = f"--config {args.config}{' ' + sets if sets else ''}"
    return (f"Start a multiple of {ranks} ranks: `torchrun --nproc-per-node {ranks} -m "
            f"megatron_calibclip.cli train {tail}`, `srun -n {ranks} calibclip train {tail}` or "
            f"`NPROC={ranks} launch/local.sh {args.config}{' ' + sets if sets else ''}`")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="calibclip",
        description="Stable full-pipeline FP8 RL (GRPO/DAPO) with Calibrated Clipping",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions and what this machine supports")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("presets", help="the model presets and their architecture numbers")
    p.set_defaults(func=_cmd_presets)
    p = sub.add_parser(
        "train", help="GRPO/DAPO training (run under torchrun or srun for several ranks)",
        description="Run RL training from a YAML config. Several ranks: launch with "
                    "`torchrun --nproc-per-node N -m megatron_calibclip.cli train ...` or srun.")
    p.add_argument("--config", required=True,
                   help="YAML file, or a bundled config name: tiny-cpu, smollm2-135m-cpu, ...")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set run.steps=5 (repeatable)")
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser(
        "te-env", help="NAME=VALUE lines Transformer Engine must be started with for a config",
        description="Print the environment variables Transformer Engine reads at import for "
                    "this config's FP8 scale options (export them before the trainers start; "
                    "launch/train.sbatch does).")
    p.add_argument("--config", required=True, help="YAML file or bundled config name")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override (repeatable)")
    p.set_defaults(func=_cmd_te_env)
    from megatron_calibclip.bench.cli import add_bench_parser
    from megatron_calibclip.checkpoint.cli import add_convert_parser
    from megatron_calibclip.experiment.cli import add_experiment_parser

    from megatron_calibclip.planner.cli import add_plan_parser
    from megatron_calibclip.probe.cli import add_probe_parser

    add_bench_parser(sub)
    add_convert_parser(sub)
    add_experiment_parser(sub)
    add_plan_parser(sub)
    add_probe_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_calibclip.fp8.gemm import gemm_path
    from megatron_calibclip.fp8.weight_cache import weight_cache_policy

    try:  # a typo in the environment is a one-line error, not a traceback at the first forward
        weight_cache_policy()
        gemm_path()
    except ValueError as err:
        print(f"calibclip: {err}", file=sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
