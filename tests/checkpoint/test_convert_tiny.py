"""HF -> Megatron -> HF on tiny random Llama / Qwen2 / Qwen3 models, tied and untied.

Converted checkpoints are loaded at TP=1, TP=2 and PP=2 and must give transformers' logits;
converting back must give the original tensors bit for bit.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.hf_models import CASES, build_hf_model, hf_logits, save_hf_model, tokens
from tests.checkpoint.helpers import first_not_none, logits_any_layout, max_abs_diff

import transformers  # noqa: F401,E402  (installed by `make test`)
pytestmark = pytest.mark.dist

# Layout each case is converted at (every family is written at TP=2 and at PP=2 once).
WRITE_LAYOUT = {"llama-tied": (1, 2), "llama-untied": (2, 1), "qwen2-tied": (2, 1),
                "qwen2-untied": (1, 2), "qwen3-tied": (2, 1), "qwen3-untied": (1, 2)}
READ_LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def _convert_body(rank, world_size, jobs):
    """jobs: [(hf_dir, out_dir, (tp, pp))] -> converts each at its layout."""
    from megatron_calibclip.checkpoint.hf_to_mcore import convert_hf_to_mcore
    from megatron_calibclip.parallel import model_parallel

    for hf_dir, out_dir, (tp, pp) in jobs:
        with model_parallel(tp=tp, pp=pp):
            convert_hf_to_mcore(hf_dir, out_dir)
    return True


def _load_logits_body(rank, world_size, ckpts, layouts, ids):
    """{ckpt: {layout: logits on the last stage or None}} after loading at each layout."""
    from megatron_calibclip.checkpoint import CheckpointInfo, CheckpointManager, load_weights
    from megatron_calibclip.models import build_policy_model
    from megatron_calibclip.parallel import model_parallel

    out = {}
    for ckpt in ckpts:
        manager = CheckpointManager(ckpt)
        cfg = CheckpointInfo.read(manager.latest()).model()
        out[ckpt] = {}
        for tp, pp in layouts:
            with model_parallel(tp=tp, pp=pp):
                model = build_policy_model(cfg, seed=123)  # different weights until loaded
                loaded = load_weights(ckpt, model) if pp > 1 else manager.load_latest(model)
                assert loaded is not None and loaded.step == 0
                out[ckpt][(tp, pp)] = logits_any_layout(model, ids, cfg.vocab_size)
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory, dist_pool):
    """HF folders, their transformers logits, and Megatron checkpoints converted from them."""
    root = tmp_path_factory.mktemp("convert_tiny")
    ids = tokens()
    cases = {}
    for name in CASES:
        model = build_hf_model(name)
        hf_dir = save_hf_model(model, root / f"hf-{name}")
        cases[name] = {"hf": hf_dir, "mcore": root / f"mcore-{name}",
                       "logits": hf_logits(model, ids).numpy()}
    jobs = [(str(c["hf"]), str(c["mcore"]), WRITE_LAYOUT[n]) for n, c in cases.items()]
    dist_pool(2).run(_convert_body, jobs)
    return cases, ids


def test_converted_logits_match_transformers_at_tp1_tp2_pp2(converted, dist_pool):
    cases, ids = converted
    ckpts = [str(c["mcore"]) for c in cases.values()]
    per_rank = dist_pool(2).run(_load_logits_body, ckpts, READ_LAYOUTS, ids)
    for name, case in cases.items():
        assert abs(case["logits"]).max() > 0.1  # a non-degenerate model
        for layout in READ_LAYOUTS:
            got = first_not_none(r[str(case["mcore"])][layout] for r in per_rank)
            diff = max_abs_diff(got, case["logits"])
            print(f"{name} TP={layout[0]} PP={layout[1]} max abs diff {diff:.3g}")
            assert diff <= 1e-4, f"{name} at TP={layout[0]} PP={layout[1]}: diff {diff:.3g}"


def test_round_trip_is_bit_identical(converted, tmp_path):
    from megatron_calibclip.checkpoint.mcore_to_hf import convert_mcore_to_hf

    cases, _ = converted
    for name, case in cases.items():
        back = convert_mcore_to_hf(case["mcore"], tmp_path / f"back-{name}")
        original = load_file(str(case["hf"] / "model.safetensors"))
        returned = load_file(str(back / "model.safetensors"))
        assert set(returned) == set(original), f"{name}: {set(returned) ^ set(original)}"
        for key, value in original.items():
            assert returned[key].dtype == value.dtype, f"{name}: {key} dtype"
            assert torch.equal(returned[key], value), f"{name}: {key} differs"
        assert json.loads((back / "config.json").read_text()) == \
            json.loads((case["hf"] / "config.json").read_text())
        assert (back / "generation_config.json").exists()  # HF assets travel with the checkpoint


def test_checkpoint_layout_on_disk(converted):
    from megatron_calibclip.checkpoint import CheckpointInfo

    cases, _ = converted
    root = Path(cases["qwen3-untied"]["mcore"])
    assert (root / "latest").read_text().strip() == "step_00000000"
    step = root / "step_00000000"
    info = CheckpointInfo.read(step)
    assert (info.layout.tp, info.layout.pp) == WRITE_LAYOUT["qwen3-untied"]
    assert info.model().kv_channels == 32 and info.model().qk_norm
    assert json.loads((step / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (step / "hf" / "config.json").exists()
    assert not [p for p in root.parent.iterdir() if p.name.endswith(".partial")]


def test_mcore_to_hf_names_missing_and_unexpected_tensors(converted, tmp_path):
    """A checkpoint whose tensors do not match its recorded config is refused by name."""
    import shutil

    from megatron_calibclip.checkpoint.errors import ConversionError
    from megatron_calibclip.checkpoint.mcore_to_hf import convert_mcore_to_hf

    cases, _ = converted
    for case, change, words in [
        ("llama-untied", {"qk_norm": True}, ["missing tensor", "_layernorm.weight"]),
        ("qwen3-untied", {"qk_norm": False}, ["unexpected tensor", "layernorm.weight"]),
        ("llama-untied", {"ffn_hidden_size": 80}, ["linear_fc1.weight", "[2, 160, 64]"]),
    ]:
        ckpt = tmp_path / f"{case}-{next(iter(change))}"
        shutil.copytree(Path(cases[case]["mcore"]) / "step_00000000", ckpt)
        info = json.loads((ckpt / "calibclip.json").read_text())
        info["model_config"].update(change)
        (ckpt / "calibclip.json").write_text(json.dumps(info))
        with pytest.raises(ConversionError) as err:
            convert_mcore_to_hf(ckpt, tmp_path / "out")
        assert all(w in str(err.value) for w in words), str(err.value)
        assert not (tmp_path / "out").exists()
