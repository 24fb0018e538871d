"""The verdict of a section and of the report, from the records the sections wrote.

Why a separate judge: a section knows its figures, not whether leaving a case unrun is
acceptable here. The rule (issue 25): a refusal, a missing backend or an exception is a
failure. A case that did not run (`"ran": false`, common.not_run) is acceptable only
- in a `--smoke` run on the CPU, for a CPU limitation (common.CPU_LIMITATIONS: no CUDA, no
  transformer-engine, CPU torch without block-scaled F.scaled_mm) that holds on this
  machine; it is listed in the report's "not_run", and the same check runs on the GPU;
- on a GPU, when this GPU's compute capability lacks the feature (common.
  NOT_SUPPORTED_BY_THIS_GPU with the capability it was decided for); listed under
  "not_supported_by_this_gpu".
Anything else not run fails its section, and the report passes only if every section
passed and (outside `--smoke`) nothing was left unrun.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

from megatron_calibclip.bench.gpu_check.common import (
    CPU_LIMITATIONS,
    NO_TE,
    NOT_SUPPORTED_BY_THIS_GPU,
    te_installed,
)


_CONTAINERS = ("cases", "runs")  # dicts of named cases: their names make the path


def entries(record: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, record) of the section itself and of every nested case that says `ran`
    ("" is the section; "K4096/blockwise/gemm" a case inside "cases")."""
    if "ran" in record:
        yield path, record
    for key, value in record.items():
        if isinstance(value, dict) and key != "thresholds":
            child = path if key in _CONTAINERS else "/".join(p for p in (path, key) if p)
            yield from entries(value, child)


def _cpu_limitation_holds(limitation: Optional[str], device: str) -> bool:
    """Whether a CPU limitation is real here (a recorded reason is not taken on trust)."""
    if limitation not in CPU_LIMITATIONS or device != "cpu":
        return False
    return not te_installed() if limitation == NO_TE else True


def classify(entry: dict[str, Any], *, smoke: bool, device: str,
             capability: Optional[Sequence[int]]) -> str:
    """'accepted' (a CPU limitation of a CPU smoke run), 'gpu' (this GPU lacks the feature)
    or 'failed', for an entry that did not run."""
    limitation = entry.get("limitation")
    if limitation == NOT_SUPPORTED_BY_THIS_GPU:
        recorded = list(entry.get("capability") or [])
        same_gpu = capability is not None and recorded == list(capability)
        return "gpu" if device == "cuda" and same_gpu else "failed"
    if smoke and _cpu_limitation_holds(limitation, device):
        return "accepted"
    return "failed"


def judge_section(name: str, record: dict[str, Any], *, smoke: bool, device: str,
                  capability: Optional[Sequence[int]] = None) -> dict[str, list]:
    """Set record["passed"] (final) and record["verdict"]; return the section's not-run
    entries: {"not_run": [...], "not_supported_by_this_gpu": [...], "failed": [...]}."""
    out: dict[str, list] = {"not_run": [], "not_supported_by_this_gpu": [], "failed": []}
    own = record.get("passed")
    for path, entry in entries(record):
        if entry.get("ran") is False:
            kind = classify(entry, smoke=smoke, device=device, capability=capability)
            item = {"section": name, "case": path or None, "why": entry.get("why"),
                    "limitation": entry.get("limitation")}
            if kind == "gpu":
                out["not_supported_by_this_gpu"].append(
                    {**item, "capability": entry.get("capability")})
                continue
            out["not_run"].append({**item, "accepted": kind == "accepted"})
            if kind == "failed":
                out["failed"].append(f"{path or name}: not run ({entry.get('why')})")
        elif entry.get("passed") is False and path:
            out["failed"].append(f"{path}: failed")
    ran = record.get("ran", True)
    if "ran" not in record:  # every section says whether it ran (common.not_run)
        out["failed"].append(f"{name}: its record does not say whether it ran")
    if "error" in record:
        out["failed"].append(f"{name}: raised {record['error']['type']}")
    elif ran and own is not True:
        out["failed"].append(f"{name}: its own thresholds failed")
    passed = not out["failed"]
    record["passed"] = passed
    if not passed:
        record["verdict"] = "FAIL: " + "; ".join(out["failed"])[:500]
    elif not ran:
        record["verdict"] = f"NOT RUN (accepted in a CPU smoke run: {record.get('why')})"
    else:
        skipped = len(out["not_run"]) + len(out["not_supported_by_this_gpu"])
        record["verdict"] = "PASS" + (f" ({skipped} case(s) not run, listed in the report)"
                                      if skipped else "")
    return out


def judge_report(report: dict[str, Any], *, smoke: bool, device: str) -> dict[str, Any]:
    """Judge every section of `report` in place; set its "not_run",
    "not_supported_by_this_gpu" and "passed"."""
    capability = report.get("machine", {}).get("compute_capability")
    not_run: list = []
    gpu: list = []
    for name, record in report["sections"].items():
        found = judge_section(name, record, smoke=smoke, device=device, capability=capability)
        not_run += found["not_run"]
        gpu += found["not_supported_by_this_gpu"]
    report["not_run"] = not_run
    report["not_supported_by_this_gpu"] = gpu
    report["passed"] = (all(r["passed"] for r in report["sections"].values())
                        and (smoke or not not_run))
    return report
