"""Progress of long conversions (a 32B model is ~400 tensors and minutes of reading).

Why a helper: only one rank should draw a bar, a bar in a SLURM log (no terminal) should be a
line every few seconds rather than a redraw every 0.1 s, and library callers (tests) want it
off by default. The CLI turns it on.
"""
from __future__ import annotations

import sys
from typing import Collection, Iterator, TypeVar

T = TypeVar("T")


def progress(items: Collection[T], *, desc: str, enabled: bool,
             unit: str = "tensor") -> Iterator[T]:
    """`items` wrapped in a tqdm bar on stderr when `enabled` (pass rank == 0 yourself)."""
    if not enabled:
        yield from items
        return
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    yield from tqdm(items, total=len(items), desc=desc, unit=unit, file=sys.stderr,
                    mininterval=0.2 if interactive else 10.0, dynamic_ncols=interactive,
                    ascii=not interactive)
