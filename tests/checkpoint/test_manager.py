"""CheckpointManager on gloo: resharding TP=2 -> TP=1 x PP=2, bit-identical resume, clipper
state, latest/retention. (Crash and preemption tests run real processes: test_crash.py,
test_preemption.py.)"""
from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch

from tests.checkpoint.helpers import build_trainable, first_not_none, logits_any_layout

pytestmark = pytest.mark.dist

SEQ, MBS = 12, 2


def _full_optimizer_state(model, optimizer, cfg, key="exp_avg"):
    """{global name: full numpy array of the Adam state `key`} on this stage."""
    from megatron.core import parallel_state

    from tests.dist_utils import full_parameter, global_name

    inner = optimizer.chained_optimizers[0].optimizer
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        value = full_parameter(p, inner.state[p][key])
        if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
            value = value[: cfg.vocab_size]
        out[global_name(name, cfg.num_layers // pp)] = value.numpy()
    return out


def _forward_step(cfg, scale, data_iterator, model):
    from megatron_calibclip.models import position_ids_for, shifted_logprobs_entropy

    tokens = next(data_iterator)
    output = model(tokens, position_ids_for(tokens), None)

    def loss_func(logits):
        logp, _ = shifted_logprobs_entropy(logits, tokens, cfg.vocab_size)
        loss = -logp.mean() * scale
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def _train_step(cfg, ddp, optimizer, tokens, scale=1.0):
    """One optimizer step with megatron's schedule; the loss on the last stage (else None)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, cfg, scale), data_iterator=iter([tokens]),
        model=[ddp], num_microbatches=1, seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0], forward_only=False)
    ok, _, _ = optimizer.step()
    assert ok
    return float(losses[0]["loss"]) if parallel_state.is_pipeline_last_stage() else None


# ---------------------------------------------------------------- resharding
def _reshard_body(rank, world_size, root, presets):
    from megatron_calibclip.checkpoint import CheckpointManager
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel
    from tests.dist_utils import full_state

    out = {}
    for preset in presets:
        cfg = get_preset(preset)
        tokens = torch.randint(0, cfg.vocab_size, (MBS, SEQ),
                               generator=torch.Generator().manual_seed(5))
        manager = CheckpointManager(f"{root}/{preset}")
        with model_parallel(tp=2):
            model, ddp, opt = build_trainable(cfg, seed=0)
            _train_step(cfg, ddp, opt, tokens)  # non-trivial weights and Adam moments
            before = {"logits": logits_any_layout(model, tokens, cfg.vocab_size),
                      "weights": full_state(model, cfg.num_layers, cfg.vocab_size, grads=False),
                      "exp_avg": _full_optimizer_state(model, opt, cfg)}
            manager.save(1, model, opt, extra_state={"data_cursor": 7})
        with model_parallel(tp=1, pp=2):
            model, ddp, opt = build_trainable(cfg, seed=99)
            loaded = manager.load_latest(ddp, opt)
            after = {"logits": logits_any_layout(model, tokens, cfg.vocab_size),
                     "weights": full_state(model, cfg.num_layers, cfg.vocab_size, grads=False),
                     "exp_avg": _full_optimizer_state(model, opt, cfg),
                     "step": loaded.step, "extra": loaded.extra_state,
                     "rng_restored": loaded.rng_restored}
        out[preset] = (before, after)
    return out


def test_save_tp2_load_tp1_pp2(dist_pool, tmp_path):
    presets = ["tiny", "tiny-qwen3"]  # tied / untied + QK-norm + head_dim != hidden/heads
    results = dist_pool(2).run(_reshard_body, str(tmp_path), presets)
    for preset in presets:
        before = results[0][preset][0]  # TP=2: both ranks hold everything
        after_logits = first_not_none(r[preset][1]["logits"] for r in results)
        diff = float(np.abs(after_logits - before["logits"]).max())
        assert diff <= 1e-5, f"{preset}: logits differ by {diff:.3g} after resharding"
        weights, exp_avg = {}, {}
        for r in results:  # union of the two pipeline stages
            weights.update(r[preset][1]["weights"])
            exp_avg.update(r[preset][1]["exp_avg"])
        for name, ref in before["weights"].items():
            if name.startswith("output_layer") and name not in weights:
                continue  # tied copy
            assert np.array_equal(weights[name], ref), f"{preset}: weight {name} changed"
            assert np.array_equal(exp_avg[name], before["exp_avg"][name]), f"{preset}: {name}"
        assert max(np.abs(v).max() for v in before["exp_avg"].values()) > 0
        meta = results[0][preset][1]
        assert meta["step"] == 1 and meta["extra"] == {"data_cursor": 7}
        assert meta["rng_restored"] is False  # layout changed: per-rank RNGs not applied


# ---------------------------------------------------------------- resume
class ToyClipper:
    """Stands in for CalibratedClipper: bounds that follow the loss (state_dict protocol)."""

    def __init__(self):
        self.lower, self.upper, self.updates = 0.8, 1.2, 0

    def update(self, loss: float) -> None:
        self.lower = 0.7 * self.lower + 0.3 * (1.0 - 0.1 * math.tanh(loss))
        self.upper = 0.7 * self.upper + 0.3 * (1.0 + 0.2 * math.tanh(loss))
        self.updates += 1

    def state_dict(self):
        return {"lower": self.lower, "upper": self.upper, "updates": self.updates}

    def load_state_dict(self, state):
        self.lower, self.upper, self.updates = state["lower"], state["upper"], state["updates"]


def _run_steps(cfg, ddp, opt, clipper, cursor, steps, dataset, record):
    import random

    for _ in range(steps):
        # data from the cursor, perturbed by torch's and Python's RNGs: a resume that lost
        # either would train on different tokens
        noise = torch.randint(0, 5, dataset[0].shape) + random.randrange(3)
        tokens = (dataset[cursor % len(dataset)] + noise) % cfg.vocab_size
        cursor += 1
        loss = _train_step(cfg, ddp, opt, tokens, scale=clipper.lower)
        clipper.update(loss)
        record.append((loss, clipper.lower, clipper.upper))
    return cursor


def _resume_body(rank, world_size, root, k, n):
    import random

    from megatron_calibclip.checkpoint import CheckpointManager
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel
    from tests.dist_utils import full_state

    cfg = get_preset("tiny-qwen2")  # QKV bias
    g = torch.Generator().manual_seed(11)
    dataset = [torch.randint(0, cfg.vocab_size, (MBS, SEQ), generator=g) for _ in range(5)]

    def fresh(seed):
        model, ddp, opt = build_trainable(cfg, seed=seed)
        torch.manual_seed(1000 + seed)
        random.seed(1000 + seed)
        return model, ddp, opt

    # uninterrupted
    with model_parallel(tp=2):
        model, ddp, opt = fresh(0)
        clipper, record = ToyClipper(), []
        _run_steps(cfg, ddp, opt, clipper, 0, n, dataset, record)
        straight = (record, full_state(model, cfg.num_layers, cfg.vocab_size, grads=False))
    # killed after step k ...
    manager = CheckpointManager(root)
    with model_parallel(tp=2):
        model, ddp, opt = fresh(0)
        clipper, record = ToyClipper(), []
        cursor = _run_steps(cfg, ddp, opt, clipper, 0, k, dataset, record)
        manager.save(k, ddp, opt, stateful={"clipper": clipper},
                     extra_state={"data_cursor": cursor})
    # ... and resumed by a new "process": other weights, other RNG states, fresh clipper
    with model_parallel(tp=2):
        model, ddp, opt = fresh(7)
        clipper = ToyClipper()
        resumed = manager.load_latest(ddp, opt, stateful={"clipper": clipper})
        assert resumed.rng_restored and resumed.step == k
        _run_steps(cfg, ddp, opt, clipper, resumed.extra_state["data_cursor"], n - k, dataset,
                   record)
        restarted = (record, full_state(model, cfg.num_layers, cfg.vocab_size, grads=False))
    # control: the same resume without restoring the RNGs must diverge (the test can fail)
    with model_parallel(tp=2):
        model, ddp, opt = fresh(7)
        clipper, control = ToyClipper(), record[:k]
        resumed = manager.load_latest(ddp, opt, stateful={"clipper": clipper},
                                      restore_rng=False)
        _run_steps(cfg, ddp, opt, clipper, resumed.extra_state["data_cursor"], n - k, dataset,
                   control)
    return straight, restarted, control


@pytest.mark.parametrize("k", [2, 0], ids=["after-2-steps", "before-any-optimizer-step"])
def test_resume_is_bit_identical(dist_pool, tmp_path, k):
    """k=0: saved before the optimizer ever stepped (DAPO can skip its first steps)."""
    n = 4
    results = dist_pool(2).run(_resume_body, str(tmp_path / "ckpt"), k, n)
    for straight, restarted, control in results:
        assert len(straight[0]) == len(restarted[0]) == n
        assert straight[0] == restarted[0]  # losses and bounds, exactly
        assert control[k:] != straight[0][k:]
        for name, value in straight[1].items():
            assert np.array_equal(value, restarted[1][name]), f"weight {name} differs"
    losses = [r[0] for r in results[0][0][0]]
    assert len(set(losses)) == n  # the steps really trained on different data


# ---------------------------------------------------------------- clipper, latest, retention
def _clipper_and_retention_body(rank, world_size, root):
    from megatron_calibclip.calibration.clipper import CalibratedClipper
    from megatron_calibclip.checkpoint import CheckpointManager
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.parallel import model_parallel

    cfg = get_preset("tiny")
    with model_parallel(tp=2):
        model = build_policy_model(cfg, seed=0)
        manager = CheckpointManager(root, keep_last=2)
        assert manager.load_latest(model) is None  # nothing saved yet
        clipper = CalibratedClipper(eps_low=0.2, eps_high=0.28)
        for step in (1, 2, 3):
            clipper.begin_step(step)
            manager.save(step, model, stateful={"clipper": clipper})
        restored = CalibratedClipper(eps_low=0.2, eps_high=0.28)
        loaded = manager.load_latest(model, stateful={"clipper": restored})
        return loaded.step, loaded.path.name, restored.state_dict() == clipper.state_dict()


def test_calibrated_clipper_state_latest_and_keep_last(dist_pool, tmp_path):
    root = tmp_path / "ckpt"
    results = dist_pool(2).run(_clipper_and_retention_body, str(root))
    assert results == [(3, "step_00000003", True)] * 2
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000003"]


# ---------------------------------------------------------------- training checkpoint -> HF
def _train_and_save_body(rank, world_size, root, preset):
    from megatron_calibclip.checkpoint import CheckpointManager
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel

    cfg = get_preset(preset)
    tokens = torch.randint(0, cfg.vocab_size, (MBS, SEQ),
                           generator=torch.Generator().manual_seed(2))
    with model_parallel(tp=2):
        model, ddp, opt = build_trainable(cfg, seed=3)
        _train_step(cfg, ddp, opt, tokens)
        CheckpointManager(root).save(1, ddp, opt)
        return tokens, logits_any_layout(model, tokens, cfg.vocab_size)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
def test_training_checkpoint_exports_to_transformers(dist_pool, tmp_path, preset):
    """No HF config recorded: mcore-to-hf writes one from the ModelConfig, and transformers
    computes the same logits as megatron did."""
    import transformers
    from megatron_calibclip.checkpoint.mcore_to_hf import convert_mcore_to_hf

    tokens, logits = dist_pool(2).run(_train_and_save_body, str(tmp_path / "ckpt"), preset)[0]
    hf_dir = convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        hf_logits = model(tokens).logits.float().numpy()
    diff = float(np.abs(hf_logits - logits).max())
    assert diff <= 1e-4, f"{preset}: transformers logits differ by {diff:.3g}"
