"""Transformer Engine's scale-format variables reach the trainers (issue 37, finding 10): TE
reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES once, at import, so launch/train.sbatch exports what
`calibclip te-env` names for the config before srun. Here the sbatch's own block (between its
`te-env` markers) runs in bash with this checkout's python, as on a GPU node."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.te_stand_in

REPO = Path(__file__).resolve().parents[2]


def _te_env_block() -> str:
    text = (REPO / "launch" / "train.sbatch").read_text()
    start = text.index("# >>> te-env")
    return text[start:text.index("# <<< te-env", start)]


def _run_block(config: str, overrides: list[str], preset: dict[str, str]) -> dict[str, str]:
    quoted = " ".join(f"'{o}'" for o in overrides)
    script = (f"set -uo pipefail\nPYTHON='{sys.executable}'\nCONFIG='{config}'\n"
              f"OVERRIDES=({quoted})\n{_te_env_block()}\nenv\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.pop("CALIBCLIP_CPU", None)
    env.update(preset)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def test_stand_in_te_env_names_the_fp32_block_scales_of_the_h100_recipes(capsys):
    from megatron_calibclip.cli import main

    for name in ("qwen3-8b-grpo", "qwen3-8b-dapo", "qwen3-14b-grpo", "qwen3-14b-dapo",
                 "qwen3-32b-grpo", "qwen3-32b-dapo"):
        assert main(["te-env", "--config", name]) == 0
        assert capsys.readouterr().out.split() == ["NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"], name
    assert main(["te-env", "--config", "tiny-cpu"]) == 0  # BF16 or emulated: nothing to set
    assert capsys.readouterr().out == ""


def test_stand_in_sbatch_exports_te_env_and_keeps_a_value_already_set():
    seen = _run_block("qwen3-8b-grpo", [], {})
    assert seen.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES") == "1"
    kept = _run_block("qwen3-8b-grpo", [], {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"})
    assert kept["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "0"  # the user's choice wins
    pow2 = _run_block("qwen3-8b-grpo", ["--set", "fp8.power_of_two_scales=true"], {})
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES" not in pow2
    cpu = _run_block("qwen3-8b-grpo", [], {"CALIBCLIP_CPU": "1"})
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES" not in cpu  # CPU mode: TE is not used
