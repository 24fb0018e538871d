"""Real processes: SIGKILL in the middle of a save, and SIGUSR1/SIGTERM preemption."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.dist


def _spawn(args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.update(env_extra or {})
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env_extra is None or var not in env_extra:
            env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "tests.checkpoint.workers", *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, procs, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"worker exited early ({p.returncode}):\n{p.stdout.read()}")
        time.sleep(0.1)
    for p in procs:
        p.kill()
    raise AssertionError("timed out waiting for the workers")


def _load_body(rank, world_size, root):
    from megatron_calibclip.checkpoint import CheckpointManager
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import model_parallel

    with model_parallel(tp=2):
        cfg = get_preset("tiny")
        model = build_policy_model(cfg, seed=5)
        expected = build_policy_model(cfg, seed=0)
        manager = CheckpointManager(root)
        loaded = manager.load_latest(model)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.parameters()))
        manager.save(3, model)  # the next save cleans up the interrupted one
        return loaded.step, loaded.extra_state, same


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, dist_pool):
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    proc = _spawn(["crash", str(root), str(ready)])
    _wait_for(ready.exists, [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    interrupted = root / ".tmp.step_00000002"
    assert any(interrupted.glob("*.distcp"))  # killed with shards already on disk
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert not (root / "step_00000002").exists()
    results = dist_pool(2).run(_load_body, str(root))
    assert results == [(1, {"tag": "one"}, True)] * 2
    assert not interrupted.exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigusr1_on_one_rank_stops_all_ranks_after_the_same_step(tmp_path):
    from megatron_calibclip.checkpoint import EXIT_PREEMPTED, CheckpointInfo

    root, progress = tmp_path / "ckpt", tmp_path / "progress"
    progress.mkdir()
    port = str(_free_port())
    procs = [_spawn(["preempt", str(root), str(progress)],
                    {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(2)]
    try:
        _wait_for(lambda: all((progress / f"rank{r}.step").exists()
                              and int((progress / f"rank{r}.step").read_text() or 0) >= 2
                              for r in range(2)), procs)
        procs[1].send_signal(signal.SIGUSR1)  # only rank 1 is told
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [EXIT_PREEMPTED] * 2, [p.stdout.read() for p in procs]
    done = [(progress / f"rank{r}.done").read_text().split() for r in range(2)]
    assert done[0][0] == done[1][0]  # same last step on both ranks
    assert done[0][1] == "0" and done[1][1] == str(int(signal.SIGUSR1))
    info = CheckpointInfo.read(root / "step_{:08d}".format(int(done[0][0]) + 1))
    assert info.layout.dp == 2 and (root / "latest").exists()


def test_sigterm_sets_the_flag_and_uninstall_restores_the_handler():
    from megatron_calibclip.checkpoint import PreemptionHandler

    previous = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler() as handler:
        assert not handler.requested and not handler.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not handler.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handler.received == signal.SIGTERM and handler.should_stop()
    assert signal.getsignal(signal.SIGTERM) == previous
