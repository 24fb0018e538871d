"""Bad configuration for `calibclip train` / `bench step`: one line naming the field, the
value and what is allowed, exit 2, no traceback, nothing started or written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_calibclip.cli import main

REPO = Path(__file__).resolve().parents[2]

# override -> words the one-line error must contain (field, value, rule)
BAD_OVERRIDES = {
    "optimizer.lr=-1": ["optimizer.lr", "-1.0", "> 0"],
    "optimizer.lr=.nan": ["optimizer.lr", "nan"],
    "run.keep_checkpoints=0": ["run.keep_checkpoints", "0", ">= 1"],
    "data.size=0": ["data.size", "0", ">= 1"],
    "data.max_prompt_tokens=-1": ["data.max_prompt_tokens", "-1", ">= 1"],
    "parallel.tp=0": ["parallel.tp", "0", ">= 1"],
    "parallel.tp=3": ["parallel.tp", "3", "num_attention_heads"],
    "parallel.pp=3": ["parallel.pp", "3", "num_layers"],
    "model.preset=gpt9": ["model.preset", "gpt9", "tiny"],
    "model.overrides.hidden_size=65": ["hidden_size", "65", "num_attention_heads"],
    "warmup.steps=-5": ["warmup.steps", "-5", ">= 0"],
    "warmup.lr=-1": ["warmup.lr", "-1.0", "> 0"],
    "optimizer.clip_grad=-1": ["optimizer.clip_grad", "-1.0", ">= 0"],
    "optimizer.weight_decay=-1": ["optimizer.weight_decay", "-1.0", ">= 0"],
    "run.save_every=-2": ["run.save_every", "-2", ">= 0"],
    "run.name=a/b": ["run.name", "a/b"],
    "data.template=no-placeholder": ["data.template", "{prompt}"],
    "algorithm.overlong_cache_length=5": ["algorithm.overlong_cache_length", "5"],
    "run.foo=1": ["run", "foo", "allowed keys"],
    "evaluation.precision=fp16": ["evaluation.precision", "fp16", "rollout", "bf16"],
    "samples.every=-1": ["samples.every", "-1", ">= 0"],
    "samples.count=0": ["samples.count", "0", ">= 1"],
    "clipping.calibration.upper_rule=l_only": ["upper_rule", "l_only", "host"],
    "clipping.calibration.retry_steps=20": ["retry_steps", "20", "period - 1"],
}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("override", sorted(BAD_OVERRIDES))
def test_bad_value_is_one_line_exit_2(override, capsys, tmp_path):
    rc = main(["train", "--config", "tiny-cpu", "--set", override,
               "--set", f"run.output_dir={tmp_path}"])
    line = _one_line(capsys)
    assert rc == 2
    assert line.startswith("calibclip train: invalid configuration: ")
    for word in BAD_OVERRIDES[override]:
        assert word in line, (word, line)
    assert not any(tmp_path.iterdir()), "nothing may be written for a bad configuration"


@pytest.mark.parametrize("text, where", [
    ("run:\n  name: x\n  steps: [1, 2\nmodel: {preset: tiny}\n", ":4:6: malformed YAML"),
    ("run:\n  name: x\n   steps: 3\n", ":3:9: malformed YAML: mapping values are not allowed here"),
])
def test_malformed_yaml_is_file_line_column(text, where, capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    assert f"{path}{where}" in _one_line(capsys)


@pytest.mark.parametrize("args, words", [
    (["--config", "nonexistent"], ["'nonexistent'", "no bundled config", "tiny-cpu"]),
    (["--config", "dapo-qwen3-14b-h100"], ["'dapo-qwen3-14b-h100'", "qwen3-14b-dapo"]),
    (["--set", "run.foo=1"], ["run", "foo", "allowed keys"]),
])
def test_bench_step_bad_config_is_one_line(args, words, capsys):
    assert main(["bench", "step", *args]) == 2
    line = _one_line(capsys)
    assert line.startswith("calibclip bench step: invalid configuration: ")
    assert all(w in line for w in words), line


def _single_process_env() -> dict:
    """This environment without a launcher's variables: a plain one-process start."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))
            and k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}


def test_too_few_ranks_says_how_to_launch(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_calibclip.cli", "train", "--config",
                           "tiny-cpu", "--set", f"run.output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=_single_process_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("calibclip train:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "torchrun --nproc-per-node 2 -m megatron_calibclip.cli train --config tiny-cpu" in lines[0]
    assert "launch/local.sh tiny-cpu" in lines[0] and "srun -n 2" in lines[0]
    assert not (tmp_path / "tiny-cpu" / "config.yaml").exists()


def _jsonl(tmp_path) -> Path:
    import json

    lines = [json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
             for a in range(4) for b in range(4)]
    lines.insert(3, "{not json")
    lines.insert(7, json.dumps({"prompt": "no answer"}))
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("on_bad", ["error", "skip"])
def test_bad_jsonl_line(on_bad, tmp_path):
    path = _jsonl(tmp_path)
    sets = ["parallel.tp=1", "data.source=jsonl", f"data.path={path}", f"data.on_bad={on_bad}",
            f"run.output_dir={tmp_path / 'runs'}", "run.steps=1", "warmup.steps=1",
            "algorithm.prompts_per_step=2", "algorithm.mini_batches=1", "run.progress=false",
            "run.plot=false", "run.tensorboard=false"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_calibclip.cli", "train", "--config", "tiny-cpu",
         *[x for kv in sets for x in ("--set", kv)]],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=_single_process_env())
    if on_bad == "error":
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("calibclip train:")]
        assert lines == [f"calibclip train: {path}:4: invalid JSON: Expecting property name "
                         f"enclosed in double quotes"], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        said = [line for line in proc.stdout.splitlines() if line.startswith("data: ")]
        want = "data: 2 record(s) skipped (data.on_bad=skip): invalid JSON x1, missing field(s) x1"
        assert said == [want, want], proc.stdout[-2000:]  # at the start and in the summary
