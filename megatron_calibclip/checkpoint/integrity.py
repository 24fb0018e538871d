"""Is a checkpoint folder intact? Name the damaged file before torch's reader fails.

Why: a truncated `.distcp` or `.metadata` makes torch.distributed.checkpoint fail deep in
its reader with several chained tracebacks that name neither the file nor the step. The
`.metadata` index records, for every saved tensor, the file, offset and length it lives at,
so a folder can be checked in milliseconds without reading the tensors: every indexed file
must exist and be at least as long as its last byte. The small JSON / torch files beside
them are parsed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

JSON_FILES = ("metadata.json", "calibclip.json")
COMMON = "common.pt"


def damaged_file(folder: Path) -> Optional[tuple[str, str]]:
    """(file name, what is wrong) for the first damaged file of a checkpoint folder, or None."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        return ".metadata", "missing"
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as err:  # noqa: BLE001 - unpickling a truncated file raises many types
        return ".metadata", f"unreadable ({type(err).__name__}: {str(err)[:80]})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            return name, "missing"
        have = path.stat().st_size
        if have < size:
            return name, f"truncated ({have} of at least {size} bytes)"
    for name in JSON_FILES:
        path = folder / name
        if path.exists():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                return name, f"unreadable ({type(err).__name__})"
    if (folder / COMMON).exists():
        try:
            torch.load(folder / COMMON, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001
            return COMMON, f"unreadable ({type(err).__name__})"
    return None
