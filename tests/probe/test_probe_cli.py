"""`calibclip probe fp8-noise` end to end on the tiny model (a subprocess: the command starts
its own 1-rank gloo world), and the parser the lead wires into cli.py."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_add_probe_parser_registers_fp8_noise():
    from megatron_calibclip.probe.cli import add_probe_parser, run_probe

    parser = argparse.ArgumentParser(prog="calibclip")
    add_probe_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["probe", "fp8-noise", "--model", "tiny", "--recipe", "blockwise",
                              "--recipe", "tensorwise,mxfp8", "--lrs", "1e-6,3e-5"])
    assert args.func is run_probe and args.probe_command == "fp8-noise"
    assert args.lrs == (1e-6, 3e-5) and args.recipe == ["blockwise", "tensorwise,mxfp8"]
    with pytest.raises(SystemExit):
        parser.parse_args(["probe"])  # the probe name is required


def _run(tmp_path, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_calibclip.probe.cli", "fp8-noise", *extra,
         "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


TINY_ARGS = ("--model", "tiny", "--num-seqs", "8", "--warmup-steps", "15", "--recipe",
             "tensorwise,blockwise", "--old-micro-batch", "4", "--micro-batch", "2", "--lrs",
             "1e-6,1e-5")


def test_fp8_noise_probe_on_tiny(tmp_path):
    """The quantizer's noise mechanisms, isolated: GEMM-only emulation (fp32 masters)."""
    proc = _run(tmp_path, *TINY_ARGS, "--emulation", "gemm_only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "phantom clips" in proc.stdout
    result = json.loads((tmp_path / "fp8_noise.json").read_text())
    assert (tmp_path / "fp8_noise.png").stat().st_size > 10_000
    assert result["config"]["recipes"] == ["tensorwise", "blockwise"]
    assert result["warmup"]["steps"] == 15
    assert result["warmup"]["loss_last"] < result["warmup"]["loss_first"]
    assert list(result["sources"]) == ["layout", "update_lr1e-06", "update_lr1e-05"]
    assert sum(result["prob_buckets"]["count"]) == result["data"]["num_tokens"] > 300
    static = result["static"]
    # FP8 log-prob error is an order of magnitude above BF16's (both against fp32)
    for r in ("tensorwise", "blockwise"):
        assert static[r]["vs_fp32"]["all_mean"] > 5 * static["bf16"]["vs_fp32"]["all_mean"]
    layout = result["sources"]["layout"]
    # mechanism 2: a shared tensorwise scale couples tokens; 1x128 tiles and BF16 do not
    assert layout["tensorwise"]["noise_std_vs_fp32"] > 1e-3
    assert layout["tensorwise"]["ratio_ne_1_frac"] > 0.5
    assert layout["blockwise"]["noise_std_vs_fp32"] < 1e-6
    assert layout["bf16"]["noise_std_vs_fp32"] < 1e-6
    for src in ("update_lr1e-06", "update_lr1e-05"):
        s = result["sources"][src]
        # mechanism 1: FP8 re-rolls its rounding after any update: noisier than BF16
        assert s["blockwise"]["noise_std_vs_fp32"] > 1.5 * s["bf16"]["noise_std_vs_fp32"] > 0
        for k in ("bf16", "tensorwise", "blockwise"):
            assert 0 <= s[k]["phantom_vs_bf16"] <= s[k]["clip_low_rate_neg"] <= 1
        changed = result["gemm_weights_changed_frac"][src]
        assert changed["fp32"] == 1.0  # every master weight moved by lr
        assert changed["blockwise"] < changed["bf16"] < 1.0  # coarser grid: fewer jumps
        assert changed["tensorwise"] == 1.0  # fp32 scale 448/amax moved: all re-quantized


def test_fp8_noise_probe_bf16_stack_vs_gemm_only(tmp_path):
    """The default emulation (bf16 model copy, bf16 activations) against the GEMM-only one on
    the same weights and tokens: BF16 gets noisier (activations, logits), FP8 re-quantizes
    far fewer weights after an update (the bf16 copy moves only where its rounding flips)."""
    results = {}
    for emulation in ("gemm_only", "bf16_stack"):
        out = tmp_path / emulation
        proc = _run(out, *TINY_ARGS, "--emulation", emulation, "--no-plot")
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[emulation] = json.loads((out / "fp8_noise.json").read_text())
    old, new = results["gemm_only"], results["bf16_stack"]
    assert (old["config"]["emulation"], new["config"]["emulation"]) == ("gemm_only", "bf16_stack")
    bf16_err = {k: r["static"]["bf16"]["vs_fp32"]["all_mean"] for k, r in results.items()}
    assert bf16_err["bf16_stack"] > 1.5 * bf16_err["gemm_only"], bf16_err
    for src in ("update_lr1e-06", "update_lr1e-05"):
        changed = {k: r["gemm_weights_changed_frac"][src]["tensorwise"] for k, r in results.items()}
        assert changed["gemm_only"] == 1.0 and changed["bf16_stack"] < 0.5, changed
    # the layout-coupling mechanism of a shared tensorwise scale is there in both
    for r in results.values():
        assert r["sources"]["layout"]["tensorwise"]["ratio_ne_1_frac"] > 0.5


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "rowise"], "probe.recipes: 'rowise' is not one of"),
    (["--model", "gpt5"], "probe.model: 'gpt5' is not one of"),
    (["--eps-low", "0"], "probe.eps_low: must be in (0, 1)"),
])
def test_fp8_noise_probe_bad_arguments(tmp_path, capsys, argv, message):
    from megatron_calibclip.probe.cli import add_probe_parser

    parser = argparse.ArgumentParser(prog="calibclip")
    add_probe_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["probe", "fp8-noise", *argv, "--out", str(tmp_path)])
    assert args.func(args) == 2  # rejected before any process group or model exists
    assert message in capsys.readouterr().err
    assert not (tmp_path / "fp8_noise.json").exists()
