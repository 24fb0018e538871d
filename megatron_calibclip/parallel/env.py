"""Where a rank learns who it is: torchrun variables, SLURM variables, or a single process.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Under `srun` with one
task per GPU, SLURM sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_JOB_NODELIST;
the master is the first host of the nodelist and the port comes from MASTER_PORT or is
derived from the job id (so that two jobs sharing a node do not collide).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Mapping

from megatron_calibclip.parallel.slurm import first_host

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST")


class DistributedEnvError(RuntimeError):
    """The launch environment is incomplete or inconsistent; the message says what to set."""


@dataclass(frozen=True)
class DistEnv:
    rank: int  # global rank of this process
    world_size: int  # number of processes in the job
    local_rank: int  # rank on this node (selects the GPU)
    master_addr: str  # host of rank 0's TCP store
    master_port: int  # port of rank 0's TCP store
    source: Literal["torchrun", "slurm", "single"]  # where the values came from


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        raise DistributedEnvError(f"environment variable {name} is not set")
    try:
        return int(raw)
    except ValueError as err:
        raise DistributedEnvError(f"environment variable {name}={raw!r} is not an integer") from err


def _port(env: Mapping[str, str], name: str, value: int) -> int:
    if not 1 <= value <= 65535:
        raise DistributedEnvError(f"{name}={value} is not a valid TCP port (1..65535)")
    return value


def read_dist_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Read the rank layout from torchrun or SLURM variables; a single process if neither.

    torchrun variables win when both are present (torchrun inside an srun step sets its own).
    A partial set of torchrun variables is an error that names the missing ones.
    """
    env = os.environ if env is None else env
    # MASTER_ADDR / MASTER_PORT alone do not make a torchrun launch: they also override the
    # SLURM defaults. A torchrun launch is recognised by its rank variables.
    present = [v for v in TORCHRUN_VARS if env.get(v)]
    if any(env.get(v) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        missing = [v for v in TORCHRUN_VARS if not env.get(v)]
        if missing:
            raise DistributedEnvError(
                f"incomplete torchrun environment: {', '.join(present)} set but "
                f"{', '.join(missing)} missing"
            )
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK")
        port = _port(env, "MASTER_PORT", _int(env, "MASTER_PORT"))
        source: Literal["torchrun", "slurm", "single"] = "torchrun"
        addr = env["MASTER_ADDR"]
    elif env.get("SLURM_PROCID") is not None and env.get("SLURM_NTASKS") is not None:
        missing = [v for v in SLURM_VARS if not env.get(v)]
        if missing:
            raise DistributedEnvError(
                f"incomplete SLURM environment: {', '.join(missing)} missing"
            )
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID")
        try:
            addr = env.get("MASTER_ADDR") or first_host(env["SLURM_JOB_NODELIST"])
        except ValueError as err:
            raise DistributedEnvError(f"SLURM_JOB_NODELIST: {err}") from err
        if env.get("MASTER_PORT"):
            port = _port(env, "MASTER_PORT", _int(env, "MASTER_PORT"))
        else:
            job = int(env.get("SLURM_JOB_ID", "0") or 0)
            port = 20000 + job % 20000
        source = "slurm"
    else:
        return DistEnv(0, 1, 0, "127.0.0.1", 0, "single")
    if world < 1:
        raise DistributedEnvError(f"world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise DistributedEnvError(f"rank {rank} is outside the world size {world}")
    if local < 0:
        raise DistributedEnvError(f"local rank must be >= 0, got {local}")
    return DistEnv(rank, world, local, addr, port, source)
