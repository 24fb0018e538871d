"""Run the selected sections one after the other, each on its own: a section that raises
records its error (type + message), counts as not run and failed, and the next one still
runs. Each section writes its figures, thresholds, reference and `ran` into its record;
verdict.py then decides what passed (a case that did not run fails, except a CPU limitation
in a `--smoke` run on the CPU, or a feature this GPU lacks) and fills the report's
"not_run" list.
"""
from __future__ import annotations

import importlib
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_calibclip.bench.gpu_check.common import case_error, free_memory
from megatron_calibclip.bench.gpu_check.options import CheckOptions
from megatron_calibclip.bench.gpu_check.verdict import judge_report, judge_section

REPORT_NAME = "gpu_check.json"
_MODULES = {"a_quantizer": "quantizer", "b_native_vs_emulated": "native_fp8",
            "c_batch_invariance": "invariance", "d_grpo": "grpo", "e_throughput": "throughput",
            "f_te_vs_emulation": "te_emulation"}


def run_section(name: str, opts: CheckOptions) -> dict[str, Any]:
    """One section's record: its own figures and verdict, or its error (then not run and
    failed); plus wall seconds. The final verdict is verdict.judge_section's."""
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"megatron_calibclip.bench.gpu_check.{_MODULES[name]}")
        record = module.run(opts)
    except Exception as err:  # noqa: BLE001 - the report says what failed; the others still run
        record = case_error(err)
    finally:
        free_memory(opts.device)
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    return record


def run_check(opts: CheckOptions, log: Callable[[str], None] = print,
              after_section: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Every selected section, in order, in one process (one torch.distributed world of 1).
    `after_section(report)` sees the report so far after each section (write it: a run cut
    short by a time limit then still leaves the sections it finished)."""
    from megatron_calibclip.bench.gpu_check.machine import machine_facts
    from megatron_calibclip.parallel import initialize_distributed

    t0 = time.perf_counter()
    report: dict[str, Any] = {"tool": "tools/gpu_check.py", "format": 2, "smoke": opts.smoke,
                              "machine": machine_facts(opts.device), "sections": {}}
    capability = report["machine"].get("compute_capability")
    initialize_distributed()  # a single process: NCCL with CUDA, gloo on the CPU
    for name in opts.sections:
        record = run_section(name, opts)
        report["sections"][name] = record
        judge_section(name, record, smoke=opts.smoke, device=opts.device, capability=capability)
        detail = f" ({record['error']['type']}: {record['error']['message'][:200]})" \
            if "error" in record else ""
        log(f"gpu_check: {name}: {record['verdict']} in {record['wall_s']:.1f}s{detail}")
        if after_section is not None:
            after_section({**report, "passed": None, "unfinished": True})
    judge_report(report, smoke=opts.smoke, device=opts.device)
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    return report


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """The one JSON file of a run, `OUT_DIR/gpu_check.json` (NaN/inf written as strings)."""
    path = Path(out_dir) / REPORT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(report), indent=1) + "\n")
    return path


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
