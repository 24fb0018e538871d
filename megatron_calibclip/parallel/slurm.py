"""SLURM hostlist expansion, needed to pick the master node from SLURM_JOB_NODELIST.

Why hand-written: `scontrol show hostnames` is not available inside every container, and
the hostlist grammar we need (prefix[a-b,c,...] with zero padding, comma-separated lists,
several bracket groups) is small.
"""
from __future__ import annotations

import re


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM nodelist {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM nodelist {text!r}")
    parts.append("".join(current))
    return [p for p in parts if p]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    out = []
    for item in spec.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"bad range {item!r} in SLURM nodelist {whole!r}")
            width = len(lo)
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            if not item.isdigit():
                raise ValueError(f"bad index {item!r} in SLURM nodelist {whole!r}")
            out.append(item)
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """'gpu[01-03,07],login1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("SLURM nodelist is empty")
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        expanded = [""]
        for token in re.findall(r"\[[^\]]*\]|[^\[]+", part):
            if token.startswith("["):
                choices = _expand_ranges(token[1:-1], nodelist)
            else:
                choices = [token]
            expanded = [e + c for e in expanded for c in choices]
        hosts.extend(expanded)
    return hosts


def first_host(nodelist: str) -> str:
    """The master node of a SLURM job: the first host of its nodelist."""
    return expand_nodelist(nodelist)[0]
