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
