"""The `calibclip` console script."""
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
    assert "megatron-core 0.16.1" in out and "torch 2.13.0" in out


def test_unknown_subcommand_fails_with_usage():
    proc = subprocess.run([sys.executable, "-m", "megatron_calibclip.cli", "fly"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'fly'" in proc.stderr
