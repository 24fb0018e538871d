"""Which code a run ran: the git commit of the checkout this package is imported from.

Why here and not in the launcher: the trainer's processes are what ran the steps, and they
import the package from wherever their interpreter finds it (a venv's editable install, or
the working folder under `python -m`), so the run itself records it (resolved.yaml on each
start); experiment/reproduce.py copies it into run_info.json.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

UNKNOWN = "unknown"


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_version(root: Optional[Path] = None) -> dict[str, str]:
    """{'code.commit': sha or 'unknown', 'code.dirty': 'true' if tracked files differ from
    it, 'false', or 'unknown'} for the checkout holding this package (or `root`)."""
    import megatron_calibclip

    root = Path(root) if root is not None else Path(megatron_calibclip.__file__).resolve().parents[1]
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    dirty = UNKNOWN if status is None else ("true" if status else "false")
    return {"code.commit": commit or UNKNOWN, "code.dirty": dirty}
