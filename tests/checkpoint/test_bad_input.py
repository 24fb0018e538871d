"""Bad input to the converters: a clear error naming the tensor or file, and no output left."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_calibclip.checkpoint.errors import CheckpointError, ConversionError
from tests.checkpoint.hf_models import build_hf_model, save_hf_model

import transformers  # noqa: F401,E402  (installed by `make test`)


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# name -> (how to break a good folder, words the error must contain)
BREAKAGES = {
    "unknown-architecture": (lambda f: _edit_config(f, model_type="mistral",
                                                    architectures=["MistralForCausalLM"]),
                             ["MistralForCausalLM", "config.json"]),
    "missing-tensor": (lambda f: _edit_tensors(
        f, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias")),
        ["missing tensor", "model.layers.1.self_attn.k_proj.bias"]),
    "extra-tensor": (lambda f: _edit_tensors(
        f, lambda t: t.__setitem__("model.layers.0.self_attn.rope.weight", torch.zeros(3))),
        ["unexpected tensor", "model.layers.0.self_attn.rope.weight", "model.safetensors"]),
    "shape-mismatch": (lambda f: _edit_tensors(
        f, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(95, 64))),
        ["model.layers.0.mlp.up_proj.weight", "[95, 64]", "[96, 64]"]),
    "truncated-file": (_truncate, ["model.safetensors", "truncated"]),
    "no-config": (lambda f: (f / "config.json").unlink(), ["config.json"]),
}


@pytest.fixture(scope="module")
def good_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad_input") / "good"
    return save_hf_model(build_hf_model("qwen2-untied"), folder)


@pytest.fixture(scope="module")
def broken(good_hf):
    folders = {}
    for name, (breakage, words) in BREAKAGES.items():
        folder = good_hf.parent / name
        shutil.copytree(good_hf, folder)
        breakage(folder)
        folders[name] = (folder, words)
    return folders


def _convert_all_body(rank, world_size, jobs):
    """Try every conversion; return {name: error message or None}."""
    from megatron_calibclip.checkpoint.hf_to_mcore import convert_hf_to_mcore
    from megatron_calibclip.parallel import model_parallel

    messages = {}
    with model_parallel(tp=2):
        for name, hf_dir, out_dir in jobs:
            try:
                convert_hf_to_mcore(hf_dir, out_dir)
                messages[name] = None
            except ConversionError as err:
                messages[name] = str(err)
    return messages


@pytest.mark.dist
def test_hf_to_mcore_bad_input_names_the_problem_and_leaves_nothing(broken, good_hf, dist_pool,
                                                                    tmp_path):
    exists = tmp_path / "exists"
    exists.mkdir()
    (exists / "keep.txt").write_text("mine")
    jobs = [(name, str(folder), str(tmp_path / f"out-{name}"))
            for name, (folder, _) in broken.items()]
    jobs.append(("target-exists", str(good_hf), str(exists)))
    results = dist_pool(2).run(_convert_all_body, jobs)
    for rank_messages in results:  # every rank fails the same way: no hang, no partial output
        for name, (_, words) in broken.items():
            message = rank_messages[name]
            assert message is not None, f"{name}: no error"
            assert all(w in message for w in words), f"{name}: {message}"
        assert "already exists" in rank_messages["target-exists"]
        assert str(exists) in rank_messages["target-exists"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]
    assert [p.name for p in exists.iterdir()] == ["keep.txt"]


def test_hf_source_validates_without_a_process_group(broken):
    from megatron_calibclip.checkpoint.hf_to_mcore import HFSource

    for name, (folder, words) in broken.items():
        with pytest.raises(ConversionError) as err:
            HFSource(folder)
        assert all(w in str(err.value) for w in words), f"{name}: {err.value}"


def test_mcore_to_hf_bad_input(tmp_path):
    from megatron_calibclip.checkpoint.mcore_to_hf import convert_mcore_to_hf

    with pytest.raises(CheckpointError, match="does not exist"):
        convert_mcore_to_hf(tmp_path / "missing", tmp_path / "out")
    not_ckpt = tmp_path / "not-a-checkpoint"
    not_ckpt.mkdir()
    with pytest.raises(CheckpointError, match="not-a-checkpoint"):
        convert_mcore_to_hf(not_ckpt, tmp_path / "out")
    with pytest.raises(ConversionError, match="already exists"):
        convert_mcore_to_hf(not_ckpt, not_ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-checkpoint"]
