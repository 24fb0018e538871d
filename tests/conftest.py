"""Shared fixtures: the distributed pool manager (see tests/harness.py)."""
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# every test that runs an emulated model also checks the weight-operand cache: a weight
# changed without bumping its version counter fails the test (fp8/weight_cache.py)
os.environ.setdefault("CALIBCLIP_WEIGHT_CACHE", "verify")

from tests.harness import PoolManager  # noqa: E402


@pytest.fixture(scope="session")
def dist_pool():
    """`dist_pool(n)` -> a live DistributedPool of n gloo ranks (reused across tests)."""
    manager = PoolManager()
    yield manager
    manager.close()
