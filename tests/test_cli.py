"""The `calibclip` console script."""
import importlib.metadata
import subprocess
import sys

from megatron_calibclip.cli import main
from megatron_calibclip.models import PRESETS


def test_presets_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    assert "8.03B" in out  # llama3-8b


def test_info_reports_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    release = importlib.metadata.version("megatron-core")
    assert f"megatron-core {release}: tested" in out and "torch 2.13.0" in out
    # both supported lines are named, whichever is installed (docs/versions.md)
    assert "0.16.x (Python 3.11), 0.19.x (Python 3.12)" in out


def test_info_names_the_release_not_megatrons_git_suffixed_version(monkeypatch, capsys):
    """0.19's megatron.core.__version__ appends the git commit of a repository its files sit
    in ("0.19.2+c5395fd" for a .venv312 inside a clone: the fresh-clone CI leg); the
    supported-release checks read the package metadata."""
    import megatron.core

    release = importlib.metadata.version("megatron-core")
    monkeypatch.setattr(megatron.core, "__version__", release + "+c5395fd")
    assert main(["info"]) == 0
    assert f"megatron-core {release}: tested" in capsys.readouterr().out


def test_info_names_the_gemm_path_and_a_bad_one_is_one_line(monkeypatch, capsys):
    from megatron_calibclip.fp8.gemm import native_bf16_gemms

    assert main(["info"]) == 0
    native, why = native_bf16_gemms()
    expected = "native (auto: " if native else "fp32 (auto: "
    assert f"GEMM path of our linears: {expected}{why}" in capsys.readouterr().out
    monkeypatch.setenv("CALIBCLIP_GEMM", "exact")
    assert main(["info"]) == 0
    assert "GEMM path of our linears: exact (requested" in capsys.readouterr().out
    monkeypatch.setenv("CALIBCLIP_GEMM", "fast")
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CALIBCLIP_GEMM='fast' is not one of" in err


def test_unknown_subcommand_fails_with_usage():
    proc = subprocess.run([sys.executable, "-m", "megatron_calibclip.cli", "fly"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'fly'" in proc.stderr
