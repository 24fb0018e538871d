#!/usr/bin/env python
"""The prepared GPU check (megatron_calibclip/bench/gpu_check.py): one run, one JSON.

    python tools/gpu_check.py --out DIR            # on one H100/H200 (CUDA)
    python tools/gpu_check.py --smoke --out DIR    # the same paths on the CPU, tiny shapes

Exit 0: every section passed; 1: a section failed (see DIR/gpu_check.json); 2: cannot run.
docs/gpu.md says how to bring megatron-core to a GPU machine without network.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--smoke", action="store_true", help="CPU rehearsal on tiny shapes")
    args = ap.parse_args(argv)
    try:
        import torch

        from megatron_calibclip.bench.gpu_check import CheckPlan, run_check
    except ImportError as err:
        print(f"gpu_check: cannot import the package or megatron-core ({err}); see docs/gpu.md",
              file=sys.stderr)
        return 2
    if args.smoke:
        plan, device = CheckPlan.smoke(), torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; use --smoke to rehearse on the CPU",
              file=sys.stderr)
        return 2
    else:
        plan, device = CheckPlan(), torch.device("cuda", 0)
    result = run_check(plan, device, Path(args.out))
    print(f"gpu_check: {'passed' if result.passed else 'FAILED'}; {Path(args.out) / 'gpu_check.json'}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
