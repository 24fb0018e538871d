"""tools/convert_checkpoint.py and megatron_calibclip.checkpoint.cli, end to end."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.hf_models import build_hf_model, save_hf_model

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "convert_checkpoint.py"
import transformers  # noqa: F401,E402  (installed by `make test`)


def _tool(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.dist
def test_tool_hf_to_mcore_at_tp2_then_back_is_bit_identical(tmp_path, capsys):
    from megatron_calibclip.checkpoint.cli import main

    hf = save_hf_model(build_hf_model("qwen3-tied", seed=4), tmp_path / "hf")
    done = _tool("hf-to-mcore", hf, tmp_path / "mcore", "--tp", "2")  # spawns 2 gloo ranks
    assert done.returncode == 0, done.stdout + done.stderr
    info = json.loads((tmp_path / "mcore" / "step_00000000" / "calibclip.json").read_text())
    assert (info["layout"]["tp"], info["layout"]["world"]) == (2, 2)
    # progress on stderr, drawn by rank 0 only: one finished bar over its parameters
    bars = [line for line in done.stderr.replace("\r", "\n").splitlines()
            if line.startswith("reading hf") and "100%" in line]
    assert len(bars) == 1, done.stderr
    assert "writing the Megatron checkpoint" in done.stderr
    assert main(["mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    assert "reading step_00000000" in capsys.readouterr().err
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" /
                                                                   "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tool_reports_bad_input_with_exit_status_2(tmp_path):
    hf = save_hf_model(build_hf_model("llama-untied"), tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, model_type="gpt_neox")))
    done = _tool("hf-to-mcore", hf, tmp_path / "out", "--tp", "2")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "gpt_neox" in done.stderr
    assert not (tmp_path / "out").exists()


def test_preset_check_and_parser(tmp_path, capsys):
    from megatron_calibclip.checkpoint.cli import add_convert_parser, run_convert

    hf = save_hf_model(build_hf_model("llama-tied"), tmp_path / "hf")
    parser = argparse.ArgumentParser(prog="calibclip")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["convert", "hf-to-mcore", str(hf), str(tmp_path / "o"),
                              "--preset", "smollm2-135m"])
    assert args.func is run_convert and (args.tp, args.pp) == (1, 1)
    assert run_convert(args) == 2
    assert "smollm2-135m" in capsys.readouterr().err
    args = parser.parse_args(["convert", "break-bf16-ties", str(hf), str(tmp_path / "t"),
                              "--seed", "3"])
    assert run_convert(args) == 0
    assert load_file(str(tmp_path / "t" / "model.safetensors")).keys() == \
        load_file(str(hf / "model.safetensors")).keys()


def test_bad_layouts_are_refused_before_any_rank_starts(tmp_path, capsys):
    from megatron_calibclip.checkpoint.cli import add_convert_parser, run_convert

    hf = save_hf_model(build_hf_model("llama-tied"), tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    parser = argparse.ArgumentParser(prog="calibclip")
    add_convert_parser(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as exit_info:  # argparse: one error line, exit 2
        parser.parse_args(["convert", "hf-to-mcore", str(hf), str(tmp_path / "o"), "--tp", "0"])
    assert exit_info.value.code == 2
    assert "argument --tp: must be >= 1, got 0" in capsys.readouterr().err
    bad_tp = cfg["num_attention_heads"] + 1  # divides neither the heads nor the KV groups
    for flag, value, words in (("--tp", bad_tp, [f"tensor-parallel size {bad_tp} must divide"]),
                               ("--pp", cfg["num_hidden_layers"] + 1, ["--pp", "must divide"])):
        args = parser.parse_args(["convert", "hf-to-mcore", str(hf), str(tmp_path / "o"),
                                  flag, str(value)])
        assert run_convert(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(w in err for w in words), err
        assert not (tmp_path / "o").exists()
