"""The training config a benchmark runs: the user's, quiet, without warm-up, and on one
process unless a launcher started several (shared by `bench step` and `bench weight-cache`)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def load_bench_config(args: argparse.Namespace, command: str, extra: Sequence[str] = ()):
    """The TrainConfig of `--config` + `--set`, or None after a one-line error on stderr."""
    from megatron_calibclip.config import ConfigError
    from megatron_calibclip.trainer.config import load_train_config

    overrides = list(args.set or []) + ["run.progress=false", "run.tensorboard=false",
                                        "run.plot=false", "warmup.steps=0", *extra]
    if "WORLD_SIZE" not in os.environ and "SLURM_NTASKS" not in os.environ:
        overrides += ["parallel.tp=1", "parallel.pp=1"]  # a single process
    try:
        return load_train_config(args.config, overrides)
    except ConfigError as err:
        print(f"calibclip bench {command}: invalid configuration: {err}", file=sys.stderr)
        return None


