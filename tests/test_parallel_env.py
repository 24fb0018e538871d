"""Launch environments and their failure modes: clear errors, never a hang."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_calibclip.parallel import (
    DistEnv,
    DistributedEnvError,
    ParallelLayout,
    ParallelLayoutError,
    expand_nodelist,
    first_host,
    initialize_distributed,
    read_dist_env,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("gpu[08-10,12],login1", ["gpu08", "gpu09", "gpu10", "gpu12", "login1"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("h100-[007,009]", ["h100-007", "h100-009"]),
        ("x,y", ["x", "y"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["", "gpu[01-03", "gpu01]", "gpu[3-1]", "gpu[a-b]"])
def test_bad_nodelist(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


def test_torchrun_env():
    env = read_dist_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                         "MASTER_ADDR": "n0", "MASTER_PORT": "29500"})
    assert env == DistEnv(3, 8, 1, "n0", 29500, "torchrun")


def test_slurm_env_picks_first_host_and_job_port():
    env = read_dist_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                         "SLURM_JOB_NODELIST": "gpu[04-05]", "SLURM_JOB_ID": "123"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 5, "gpu04")
    assert env.master_port == 20123 and env.source == "slurm"


def test_torchrun_vars_win_over_slurm():
    env = read_dist_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                         "MASTER_PORT": "1234", "SLURM_PROCID": "7", "SLURM_NTASKS": "9"})
    assert env.source == "torchrun" and env.world_size == 2


def test_single_process_without_variables():
    assert read_dist_env({}).source == "single"


@pytest.mark.parametrize(
    "env, match",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing"),
        ({"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
          "MASTER_PORT": "1"}, "WORLD_SIZE='two' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
          "MASTER_PORT": "1"}, "rank 2 is outside the world size 2"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
          "MASTER_PORT": "70000"}, "not a valid TCP port"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"},
         "SLURM_JOB_NODELIST missing"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
          "SLURM_JOB_NODELIST": "gpu[1-"}, "SLURM_JOB_NODELIST"),
    ],
)
def test_bad_environment_names_the_variable(env, match):
    with pytest.raises(DistributedEnvError, match=match):
        read_dist_env(env)


@pytest.mark.parametrize("layout, world, match", [
    (ParallelLayout(tp=3), 4, r"world size 4 is not divisible by TP x PP x CP = 3 x 1 x 1 = 3"),
    (ParallelLayout(tp=2, pp=2), 6, r"= 2 x 2 x 1 = 4"),
    (ParallelLayout(tp=0), 4, "tensor-parallel size must be >= 1"),
])
def test_layout_that_does_not_divide_the_world_fails_before_any_communication(layout, world,
                                                                              match):
    env = DistEnv(0, world, 0, "127.0.0.1", 1, "torchrun")  # port 1: nothing may connect
    start = time.monotonic()
    with pytest.raises(ParallelLayoutError, match=match):
        initialize_distributed(layout, env=env, timeout_s=5)
    assert time.monotonic() - start < 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_init(env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """initialize_distributed in a fresh interpreter (a failed init must not touch pytest's)."""
    code = textwrap.dedent("""
        from megatron_calibclip.parallel import initialize_distributed, ParallelLayout
        initialize_distributed(ParallelLayout(), timeout_s=3)
    """)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_port_in_use_is_reported_with_the_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = _run_init({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert proc.returncode != 0
    assert f"MASTER_PORT {port} on 127.0.0.1 is already in use" in proc.stderr


def test_unreachable_master_times_out_with_a_clear_error():
    port = _free_port()
    start = time.monotonic()
    proc = _run_init({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert proc.returncode != 0
    assert f"could not reach the master 127.0.0.1:{port}" in proc.stderr
    assert time.monotonic() - start < 45


SLURM_BODY = textwrap.dedent("""
    import torch, torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron_calibclip.parallel import initialize_distributed, ParallelLayout, teardown
    env = initialize_distributed(ParallelLayout(tp=2), timeout_s=60)
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    print(f"OK rank={env.rank} source={env.source} tp={ps.get_tensor_model_parallel_world_size()}"
          f" sum={t.item()}")
    teardown()
""")


def test_two_ranks_start_from_slurm_variables():
    """As under `srun -n2`: SLURM_* only, master taken from the nodelist."""
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
        env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
        env.update({"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                    "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": port,
                    "OMP_NUM_THREADS": "1"})
        procs.append(subprocess.Popen([sys.executable, "-c", SLURM_BODY], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-2000:]
        assert f"OK rank={rank} source=slurm tp=2 sum=3.0" in out


TIMEOUT_BODY = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from megatron_calibclip.parallel import initialize_distributed, ParallelLayout, teardown
    from megatron_calibclip.parallel.initialize import _registered_groups
    from megatron_calibclip.trainer.config import ParallelSection
    layout = ParallelSection(timeout_minutes={minutes}).layout() if {minutes} else ParallelLayout()
    initialize_distributed(layout)
    seen = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for g in _registered_groups()]
    print(json.dumps(seen))
    teardown()
""")


@pytest.mark.te_stand_in
@pytest.mark.parametrize("minutes, expected_s", [(0, 1800.0), (45, 2700.0)],
                         ids=["default-30-min", "parallel.timeout_minutes-45"])
def test_timeout_minutes_reaches_every_process_group(minutes, expected_s):
    """Issue 37 finding 5: the default group's and every megatron group's timeout are the
    layout's (not torch's rendezvous 300 s); read back from each gloo backend's options."""
    proc = subprocess.run([sys.executable, "-c", TIMEOUT_BODY.format(minutes=minutes)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith(("SLURM_", "MASTER_"))
                               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(seen) >= 5, seen  # world, TP, PP, DP, model-parallel, ... groups
    assert set(seen) == {expected_s}, seen


@pytest.mark.te_stand_in
def test_timeout_minutes_must_be_positive():
    from megatron_calibclip.config import ConfigError
    from megatron_calibclip.trainer.config import ParallelSection

    with pytest.raises(ConfigError, match="parallel.timeout_minutes"):
        ParallelSection(timeout_minutes=0)
