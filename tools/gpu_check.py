#!/usr/bin/env python
"""A prepared GPU check: quantizer and FP8 GEMMs vs independent references, emulated vs
native FP8 (forward and backward), batch invariance, Transformer Engine vs our emulation,
FP8/BF16 step throughput, GRPO steps in BF16 and FP8 with Calibrated Clipping; one JSON.

    python tools/gpu_check.py --out DIR              # one H100/H200, at most ~8 minutes
    python tools/gpu_check.py --smoke --out DIR      # the same paths, tiny shapes, on a CPU

Writes DIR/gpu_check.json. It cannot pass by mistake: a case that did not run (a refusal, a
missing backend or an exception) fails its section. The one exception is a `--smoke` run on
the CPU, which may leave unrun what a CPU cannot do (no CUDA, no transformer-engine, no
block-scaled F.scaled_mm); those cases are listed in the report's "not_run". On a GPU, only
a recipe its compute capability lacks (mxfp8 before 10.0, blockwise off Hopper) is excused,
listed under "not_supported_by_this_gpu". Exit 0: every section passed (and, outside
--smoke, nothing was left unrun); 1: a section failed (its error, figures or unrun cases are
in the JSON); 2: cannot run here. Sections: megatron_calibclip/bench/gpu_check/__init__.py;
see docs/gpu.md (how to bring megatron-core to a GPU machine without network).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _register_checkout_patches() -> None:
    """Make `megatron_calibclip.patches` importable from a bare checkout (PYTHONPATH, no pip
    install: the GPU machine's Python 3.12 is outside setup.py's python_requires). setup.py
    installs the top-level `patches/` folder under that name; this does the same in-process."""
    import megatron_calibclip

    if importlib.util.find_spec("megatron_calibclip.patches") is not None:
        return
    folder = os.path.join(ROOT, "patches")
    spec = importlib.util.spec_from_file_location(
        "megatron_calibclip.patches", os.path.join(folder, "__init__.py"),
        submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["megatron_calibclip.patches"] = module
    spec.loader.exec_module(module)
    megatron_calibclip.patches = module


def _import_problem() -> str | None:
    """One line naming what is missing, or None when the package and megatron-core import."""
    try:
        import megatron.core  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure ends the check here
        return (f"cannot import megatron.core ({type(err).__name__}: {err}); install the wheel "
                f"(pip install --no-index --no-deps --target /tmp/site megatron_core-*.whl) and "
                f"set PYTHONPATH=/tmp/site (docs/gpu.md)")
    try:
        _register_checkout_patches()
        import megatron_calibclip.bench.gpu_check  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return f"cannot import megatron_calibclip ({type(err).__name__}: {err}); run from the checkout"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and steps (CPU CI)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when available, else cpu")
    parser.add_argument("--sections", nargs="+", metavar="NAME",
                        help="run only these sections (default: all)")
    args = parser.parse_args(argv)

    problem = _import_problem()
    if problem is not None:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    import torch

    from megatron_calibclip.bench.gpu_check import (
        SECTION_NAMES,
        CheckOptions,
        run_check,
        write_report,
    )

    sections = tuple(args.sections or SECTION_NAMES)
    unknown = sorted(set(sections) - set(SECTION_NAMES))
    if unknown:
        print(f"gpu_check: unknown sections {unknown}; choose from {list(SECTION_NAMES)}",
              file=sys.stderr)
        return 2
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if device == "cpu" and not args.smoke:
        print("gpu_check: note: full sizes on a CPU take hours; use --smoke", file=sys.stderr)
    opts = CheckOptions.for_run(device, args.smoke, sections)
    report = run_check(opts, log=lambda line: print(line, file=sys.stderr, flush=True),
                       after_section=lambda partial: write_report(partial, args.out))
    path = write_report(report, args.out)
    print(f"gpu_check: {'PASS' if report['passed'] else 'FAIL'} in {report['wall_s']:.1f}s; "
          f"report: {path}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
