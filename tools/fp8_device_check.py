#!/usr/bin/env python
"""Moved: the comparison of the CPU emulation with Transformer Engine (one linear: output and
both gradients; a small GPT: FP8 log-probs, per recipe) is now the section
`f_te_vs_emulation` of tools/gpu_check.py (megatron_calibclip/bench/gpu_check/
te_emulation.py), where its models are built as the trainer builds them and a recipe that
cannot run fails instead of being skipped.

    python tools/fp8_device_check.py --out DIR
    # is: python tools/gpu_check.py --sections f_te_vs_emulation --out DIR

Any further arguments are passed to tools/gpu_check.py.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    import gpu_check

    args = list(sys.argv[1:] if argv is None else argv)
    if "--sections" not in args:
        args += ["--sections", "f_te_vs_emulation"]
    return gpu_check.main(args)


if __name__ == "__main__":
    sys.exit(main())
