"""Without a SLURM cluster the SLURM tests skip locally but fail under CI (CI=true)."""
import pytest

from tests.slurm.conftest import _unavailable


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_ci_fails_when_the_cluster_is_unavailable(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception,
                       match="CI=true but the local SLURM cluster is unavailable: why"):
        _unavailable("why")


@pytest.mark.parametrize("value", [None, "false", ""])
def test_elsewhere_it_skips(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match="why"):
        _unavailable("why")
