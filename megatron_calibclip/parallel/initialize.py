"""Start torch.distributed and megatron-core's parallel_state, and tear them down cleanly.

NCCL when CUDA is available, gloo otherwise (then the CPU patches for megatron-core are
applied). Every failure mode we have met names its cause instead of hanging: a layout that
does not divide the world size is rejected before any communication, the TCP store is
created explicitly so that a port in use or an unreachable master is reported with the
address, and every wait has a timeout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_calibclip.parallel.env import DistEnv, DistributedEnvError, read_dist_env


class ParallelLayoutError(ValueError):
    """TP x PP x CP does not fit the world size (or a size is not positive)."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    cp: int = 1  # context-parallel size
    # every process group's collective timeout (the default group's and megatron's). Why 30:
    # at 8B the DP-rank-0 ranks write ~33 GB each while the others wait in the checkpoint
    # writer's final collective; torch's and megatron's own default is 30 minutes too.
    timeout_minutes: float = 30.0

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world / (TP x PP x CP), or a ParallelLayoutError that names the numbers."""
        if not self.timeout_minutes > 0:
            raise ParallelLayoutError(f"timeout_minutes must be > 0, got {self.timeout_minutes}")
        for name, value in (("tensor", self.tp), ("pipeline", self.pp), ("context", self.cp)):
            if value < 1:
                raise ParallelLayoutError(f"{name}-parallel size must be >= 1, got {value}")
        model = self.tp * self.pp * self.cp
        if world_size % model != 0:
            raise ParallelLayoutError(
                f"world size {world_size} is not divisible by TP x PP x CP = "
                f"{self.tp} x {self.pp} x {self.cp} = {model}"
            )
        return world_size // model


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _create_store(env: DistEnv, timeout: datetime.timedelta) -> dist.Store:
    # Under torchrun the elastic agent already serves the store on MASTER_PORT: every rank,
    # rank 0 included, connects to it as a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = env.rank == 0 and not agent_store
    try:
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=is_master,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as err:  # DistNetworkError / DistStoreError subclass these
        text = str(err).lower()
        if is_master and ("in use" in text or "address already" in text or "errno: 98" in text):
            raise DistributedEnvError(
                f"MASTER_PORT {env.master_port} on {env.master_addr} is already in use; "
                f"pick a free port (e.g. MASTER_PORT=$((20000 + RANDOM % 20000)))"
            ) from err
        if "timeout" in text or "timed out" in text:
            raise DistributedEnvError(
                f"rank {env.rank} could not reach the master {env.master_addr}:"
                f"{env.master_port} within {timeout.total_seconds():.0f}s"
            ) from err
        raise DistributedEnvError(
            f"rank {env.rank}: cannot create the TCP store at {env.master_addr}:"
            f"{env.master_port}: {err}"
        ) from err


def initialize_distributed(
    layout: ParallelLayout | None = None,
    *,
    backend: str | None = None,
    timeout_s: float | None = None,
    env: DistEnv | None = None,
    seed: int = 1234,
) -> DistEnv:
    """Initialise torch.distributed from the launch environment, then megatron's groups.

    Returns the DistEnv. Idempotent for torch.distributed: if it is already initialised
    (e.g. by a test harness) only the model-parallel groups are created. `timeout_s` (the
    rendezvous and every group's timeout) defaults to the layout's `timeout_minutes`.
    """
    layout = layout or ParallelLayout()
    if dist.is_initialized():
        env = env or DistEnv(dist.get_rank(), dist.get_world_size(),
                             int(os.environ.get("LOCAL_RANK", "0")), "", 0, "torchrun")
        layout.data_parallel_size(env.world_size)
    else:
        env = env or read_dist_env()
        layout.data_parallel_size(env.world_size)  # fail before any communication
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        timeout = datetime.timedelta(
            seconds=timeout_s if timeout_s is not None else layout.timeout_minutes * 60)
        if env.source == "single":
            store: dist.Store = dist.HashStore()
        else:
            store = _create_store(env, timeout)
        dist.init_process_group(
            backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
    if timeout_s is not None:  # one timeout for every group, the model-parallel ones too
        layout = dataclasses.replace(layout, timeout_minutes=timeout_s / 60)
    initialize_model_parallel(layout, seed=seed)
    return env


# Process groups created by megatron's initialize_model_parallel, destroyed by
# teardown_model_parallel. Why: megatron's destroy_model_parallel only drops its references;
# torch.distributed keeps every group (and, with gloo, its 2-3 polling threads) registered
# until destroyed. A process that re-initialises megatron (the test pool's workers, tools that
# switch layouts) would otherwise accumulate thousands of threads: measured here, two workers
# reached ~1,900 threads each and most of two cores went to their polling.
_OWNED_GROUPS: list = []


def _registered_groups() -> list:
    """Every process group torch.distributed has registered (private map; [] if it moved)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


def _destroy_owned_groups() -> None:
    alive = set(_registered_groups())  # [] once the default group is gone: nothing to do
    for group in reversed(_OWNED_GROUPS):
        if group not in alive:
            continue
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - best effort: never fail a teardown
            pass
    _OWNED_GROUPS.clear()


def initialize_model_parallel(layout: ParallelLayout, *, seed: int = 1234) -> None:
    """Create megatron's TP/PP/CP/DP groups (torch.distributed must be up) and seed RNGs."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_calibclip.patches import apply_cpu_patches

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call initialize_distributed")
    layout.data_parallel_size(dist.get_world_size())
    apply_cpu_patches()  # no-op with CUDA
    if parallel_state.model_parallel_is_initialized():
        teardown_model_parallel()
    before = set(_registered_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        distributed_timeout_minutes=layout.timeout_minutes,
    )
    created = [g for g in _registered_groups() if g not in before]
    _OWNED_GROUPS.extend(created)
    _apply_timeout(created, datetime.timedelta(minutes=layout.timeout_minutes))
    model_parallel_cuda_manual_seed(seed)


def _apply_timeout(groups: list, timeout: datetime.timedelta) -> None:
    """Give every group megatron just created the layout's timeout.

    Why: megatron-core 0.16.1 creates EXPERT_DATA_PARALLEL_GROUP_GLOO without its
    `distributed_timeout_minutes` (parallel_state.py, the expert-DP loop), so that group keeps
    torch's default whatever the layout asks; torch's own setter fixes it without a patch.
    """
    for group in groups:
        try:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        except ValueError:  # a group this rank is not in
            continue


def teardown_model_parallel() -> None:
    """Destroy megatron's groups (if any) and free them; torch.distributed stays up."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _destroy_owned_groups()
    # megatron keeps a global memory buffer and the RNG tracker across inits
    try:
        from megatron.core.tensor_parallel import random as mp_random

        mp_random.get_cuda_rng_tracker().reset()
    except Exception:  # noqa: BLE001 - best effort
        pass


# Called (newest first) by teardown() while the process groups still exist: an in-process
# engine that built groups on our world (vLLM's external_launcher) shuts down here, not at
# interpreter exit, when its group teardown would meet groups we already destroyed.
_BEFORE_TEARDOWN: list[Callable[[], None]] = []


def before_teardown(fn: Callable[[], None]) -> None:
    """Run `fn` at the start of the next teardown() (once)."""
    _BEFORE_TEARDOWN.append(fn)


def teardown() -> None:
    """Run the before_teardown hooks, destroy megatron's groups and the default group."""
    while _BEFORE_TEARDOWN:
        _BEFORE_TEARDOWN.pop()()
    teardown_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def model_parallel(tp: int = 1, pp: int = 1, cp: int = 1, *, seed: int = 1234) -> Iterator[None]:
    """`with model_parallel(tp=2): ...` inside an initialised world (tests, tools)."""
    initialize_model_parallel(ParallelLayout(tp, pp, cp), seed=seed)
    try:
        yield
    finally:
        teardown_model_parallel()
