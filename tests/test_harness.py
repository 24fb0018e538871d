"""The distributed test harness itself: results per rank, errors and hangs surface as failures."""
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import PoolTimeout, RankError


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would hang here forever without the harness' grace period
    return rank


def _sleep(rank, world_size, seconds):
    time.sleep(seconds)
    return rank


def test_results_come_back_per_rank(dist_pool):
    assert dist_pool(2).run(_allreduce_rank) == [3.0, 3.0]


def test_error_on_one_rank_fails_fast_with_traceback(dist_pool):
    start = time.monotonic()
    with pytest.raises(RankError, match="boom on rank 1"):
        dist_pool(2).run(_raise_on_rank1)
    assert time.monotonic() - start < 30
    # the pool was replaced: the next task runs on fresh ranks
    assert dist_pool(2).run(_allreduce_rank) == [3.0, 3.0]


def test_timeout_kills_the_pool(dist_pool):
    with pytest.raises(PoolTimeout, match="did not answer"):
        dist_pool(2).run(_sleep, 60, timeout=2)
    assert dist_pool(2).run(_allreduce_rank) == [3.0, 3.0]


def _threads_after_reinit(rank, world_size, times):
    """Native thread count and registered groups after each of `times` megatron re-inits."""
    import os

    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.parallel.initialize import _registered_groups

    counts = []
    for i in range(times):
        with model_parallel(tp=2 if i % 2 else 1):
            t = torch.ones(1)
            dist.all_reduce(t)  # the groups work while they exist
            assert t.item() == world_size
            during = len(_registered_groups())
        counts.append((len(os.listdir("/proc/self/task")), len(_registered_groups()), during))
    return counts


def test_megatron_reinit_frees_its_process_groups_and_threads(dist_pool):
    """A worker that re-initialises megatron many times must not accumulate gloo groups/threads."""
    for counts in dist_pool(2).run(_threads_after_reinit, 6):
        threads = [c[0] for c in counts]
        groups = [c[1] for c in counts]
        assert all(c[2] > c[1] for c in counts), counts  # megatron did create groups
        assert len(set(groups)) == 1, counts  # back to the same registered set every time
        assert threads[-1] <= threads[1] + 2, counts  # no growth (leak was ~+150 per init)
