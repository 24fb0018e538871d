"""Where things are on disk and how a checkpoint becomes visible: atomically.

    ROOT/
      latest                 text file naming the committed checkpoint ("step_00000042")
      step_00000042/         one checkpoint: megatron torch_dist files + calibclip.json
      step_00000042.1/       the same step saved again (e.g. preempted right after a resume)
      .tmp.step_00000043/    a save in progress (or interrupted): never read, removed later

Why this order (write into .tmp, fsync, rename, then replace `latest`): rename and replace are
atomic on POSIX file systems, so a crash at any point leaves `latest` naming a complete
checkpoint; the worst case is an orphan .tmp folder (or a finished step folder that `latest`
does not name yet); the next save removes the orphans.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

from megatron_calibclip.checkpoint.errors import CheckpointError

LATEST = "latest"
TMP_PREFIX = ".tmp."
_STEP_RE = re.compile(r"^step_(\d{8,})(?:\.(\d+))?$")  # step_00000042[.k] (k-th re-save)


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def step_of(dirname: str) -> Optional[int]:
    m = _STEP_RE.match(dirname)
    return int(m.group(1)) if m else None


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside `path` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` by a file holding `text`, atomically and durably."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_latest(root: Path) -> Optional[Path]:
    """The committed checkpoint named by ROOT/latest, or None if nothing was committed."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    if step_of(name) is None:
        raise CheckpointError(f"{pointer} does not name a checkpoint folder: {name!r}")
    path = root / name
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names {name}, but {path} does not exist")
    return path


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def commit(tmp: Path, final: Path) -> Path:
    """Move a fully written checkpoint into place and point `latest` at it (one process).

    If `final` exists (the same step saved again, e.g. after a resume), the new copy goes to
    `final.1` (`.2`, ...) and the old one is deleted only after `latest` names the new one, so
    no moment exists where `latest` names a missing or partial folder. Returns the folder.
    """
    _fsync_tree(tmp)
    target, k = final, 0
    while target.exists():
        k += 1
        target = final.with_name(f"{final.name}.{k}")
    os.replace(tmp, target)
    fsync_dir(target.parent)
    write_text_atomic(target.parent / LATEST, target.name + "\n")
    for i in range(k):  # superseded copies of the same step
        shutil.rmtree(final if i == 0 else final.with_name(f"{final.name}.{i}"),
                      ignore_errors=True)
    return target


def remove_stale(root: Path) -> list[Path]:
    """Delete what interrupted saves left behind (.tmp.* entries); committed data is kept.

    A step folder that `latest` does not name yet (crash between rename and pointer update)
    is left alone: it is complete, and it is replaced when that step is saved again.
    """
    removed = []
    for child in root.iterdir():
        if child.name.startswith(TMP_PREFIX):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child)
    return removed


def prune(root: Path, keep_last: int) -> list[Path]:
    """Keep the `keep_last` newest committed checkpoints (never the one `latest` names)."""
    latest = read_latest(root)
    steps = sorted(
        (s, child.name, child) for child in root.iterdir()
        if child.is_dir() and (s := step_of(child.name)) is not None
        and (latest is None or s <= step_of(latest.name))
    )
    doomed = [c for _, _, c in steps[: max(0, len(steps) - keep_last)] if c != latest]
    for child in doomed:
        shutil.rmtree(child, ignore_errors=True)
    return doomed


def resolve_checkpoint(path: os.PathLike | str) -> Path:
    """A checkpoint folder, or a ROOT whose `latest` names one -> the checkpoint folder."""
    path = Path(path)
    if (path / LATEST).exists():
        found = read_latest(path)
        assert found is not None
        return found
    if (path / "metadata.json").exists():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    raise CheckpointError(
        f"{path} is neither a checkpoint folder (no metadata.json) nor a checkpoint root "
        f"(no '{LATEST}' file)"
    )
