"""End the process with a clear line when an engine call hangs.

Why a process exit: an in-process engine that hangs (a stuck collective between engine
ranks, a kernel that never returns) cannot be interrupted from Python, and the other ranks
then wait in their next collective forever. A timer thread that prints what hung, dumps every
thread's stack (faulthandler) and exits makes torchrun / SLURM end the whole job with the
reason on record, instead of a silent hang.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from typing import Iterator

EXIT_ENGINE_HUNG = 3  # the process's exit code when a guarded call timed out


def _abort(what: str, seconds: float, setting: str) -> None:
    print(f"calibclip: {what} made no progress for {seconds:g} s ({setting}); ending the run "
          f"(stacks of every thread follow)", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_ENGINE_HUNG)


@contextlib.contextmanager
def deadline(what: str, seconds: float, setting: str) -> Iterator[None]:
    """Run the block; if it lasts more than `seconds` (0: no limit), exit the process with
    EXIT_ENGINE_HUNG after printing `what` and the config field (`setting`) to raise."""
    if seconds <= 0:
        yield
        return
    timer = threading.Timer(seconds, _abort, args=(what, seconds, setting))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
