"""Stop cleanly when the scheduler says the job is about to be killed.

Why: SLURM sends SIGTERM (or, with `#SBATCH --signal=USR1@120`, SIGUSR1 some seconds early)
before SIGKILL. A handler that only sets a flag lets the current step finish; the loop then
agrees across ranks (all-reduce MAX, so that every rank stops after the same step even if
only one was signalled), saves a checkpoint, and exits with EXIT_PREEMPTED so the launch
script can requeue the job::

    with PreemptionHandler() as preempt:
        for step in range(start, num_steps):
            train_step(step)
            if preempt.should_stop():            # collective: call it on every rank
                ckpt.save(step + 1, model, optimizer, ...)
                sys.exit(EXIT_PREEMPTED)

    # launch script:  rc=$?; [ $rc -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"
"""
from __future__ import annotations

import signal
from types import FrameType
from typing import Callable, Optional, Sequence, Union

import torch.distributed as dist

from megatron_calibclip.parallel.flags import any_rank

EXIT_PREEMPTED = 75  # EX_TEMPFAIL after a preemption save: "requeue me" (not 124, which `timeout` uses)
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_Handler = Union[Callable[[int, Optional[FrameType]], object], int, None]


class PreemptionHandler:
    """Turns SIGTERM/SIGUSR1 into a flag that the training loop polls between steps."""

    def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        self.signals = tuple(signals)
        self.group = group  # ranks that must agree (default: all)
        self.received: Optional[int] = None  # the first signal received, if any
        self._previous: dict[int, _Handler] = {}

    @property
    def requested(self) -> bool:
        """True once this rank received one of the signals (local; no communication)."""
        return self.received is not None

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received is None:
            self.received = signum

    def install(self) -> "PreemptionHandler":
        """Install the handlers (main thread only); the previous ones are kept for uninstall."""
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def should_stop(self) -> bool:
        """Collective: True on every rank if any rank was signalled. Call once per step."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        return any_rank(self.requested, self.group)
