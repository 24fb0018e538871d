"""Run a test body on N gloo ranks in spawned processes, with a timeout, reusing the processes.

Why a pool: starting a rank costs seconds (importing torch + megatron-core), so the N worker
processes and their default gloo group are started once and reused by every test that asks
for the same world size. A test sends a module-level function; every rank runs it and the
per-rank return values come back as a list indexed by rank.

Never a hang: if any rank raises, the others get a short grace period and the pool is then
killed and the error (with the rank's traceback) is raised in the test; if the task runs past
its timeout, or a worker process dies, the pool is killed and the test fails naming the ranks
that did not answer. A killed pool is replaced transparently on the next request.

Usage in a test::

    def _body(rank, world_size, x):          # module level, so it can be pickled
        ...
        return value

    def test_something(dist_pool):
        results = dist_pool(2).run(_body, 3.0)   # [value_rank0, value_rank1]
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT_S = float(os.environ.get("CALIBCLIP_TEST_TIMEOUT", "180"))
STARTUP_TIMEOUT_S = 120.0
ERROR_GRACE_S = 3.0


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


class PoolTimeout(RuntimeError):
    """A task or the start-up ran past its limit; the pool was killed."""


def _worker_main(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
        )
        # Activate the CPU support for megatron-core before any test body imports it.
        from megatron_calibclip.patches import apply_cpu_patches

        apply_cpu_patches()
        results.put(("ready", rank, True, None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put(("ready", rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            value = fn(rank, world_size, *args, **kwargs)
            results.put((task_id, rank, True, value))
        except BaseException:  # noqa: BLE001
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:
            _reset_model_parallel()
    # no destroy_process_group(): it waits for the peers, and the process is exiting anyway


def _reset_model_parallel() -> None:
    """Leave no megatron parallel state behind for the next task on this worker."""
    try:
        from megatron_calibclip.parallel import teardown_model_parallel

        teardown_model_parallel()
    except Exception:  # noqa: BLE001
        pass


class DistributedPool:
    """N spawned gloo ranks that run test bodies on request."""

    def __init__(self, world_size: int, startup_timeout: float = STARTUP_TIMEOUT_S):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="calibclip-pool-")
        init_file = os.path.join(self._tmpdir, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, world_size, init_file, self._tasks[r], self._results),
                daemon=True,
                name=f"calibclip-rank{r}",
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next_id = 0
        self.alive = True
        self._collect("ready", startup_timeout)

    def _collect(self, task_id: Any, timeout: float) -> list:
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace_deadline = None
        while len(values) + len(errors) < self.world_size:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            try:
                tid, rank, ok, payload = self._results.get(timeout=min(0.5, limit - now))
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead and grace_deadline is None:
                    grace_deadline = time.monotonic() + ERROR_GRACE_S
                    for p in self._procs:
                        if not p.is_alive():
                            errors[int(p.name.replace("calibclip-rank", ""))] = (
                                f"process exited with code {p.exitcode}"
                            )
                continue
            if tid != task_id:  # stale message from a task that was abandoned
                continue
            if ok:
                values[rank] = payload
            else:
                errors[rank] = payload
                if grace_deadline is None:
                    grace_deadline = time.monotonic() + ERROR_GRACE_S
        missing = [r for r in range(self.world_size) if r not in values and r not in errors]
        if errors:
            self.close(kill=True)
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            if missing:
                msg += f"\n(ranks {missing} did not finish; pool killed)"
            raise RankError(msg)
        if missing:
            self.close(kill=True)
            raise PoolTimeout(
                f"ranks {missing} of {self.world_size} did not answer within {timeout:.0f}s "
                f"(task {task_id!r}); pool killed"
            )
        return [values[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run fn(rank, world_size, *args, **kwargs) on every rank; return per-rank results."""
        if not self.alive:
            raise RuntimeError("this pool was closed")
        self._next_id += 1
        for q in self._tasks:
            q.put((self._next_id, fn, args, kwargs))
        return self._collect(self._next_id, DEFAULT_TIMEOUT_S if timeout is None else timeout)

    def close(self, kill: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 5
            for p in self._procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._tmpdir, ignore_errors=True)


class PoolManager:
    """Keeps one live pool per world size; replaces pools that were killed."""

    def __init__(self) -> None:
        self._pools: dict[int, DistributedPool] = {}

    def __call__(self, world_size: int) -> DistributedPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            # Idle pools cost memory only (no CPU), so pools of different sizes are kept.
            pool = DistributedPool(world_size)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
