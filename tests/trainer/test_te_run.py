"""Issue 25 item 2: the trainer on megatron-core's Transformer Engine path, checked on a CPU.

TE cannot be imported here, so what is checked is everything around it: which backend and
layer spec a run resolves to on a GPU machine, the one-line refusals, the recipe ->
TransformerConfig mapping (tests/fp8/test_recipe.py), the padding-aware causal mask, and,
on a model built through the TE path with megatron's local modules standing in for TE's,
that the BF16 shadow pass is megatron's FP8 context switched off on the same module, that
entering FP8 re-arms TE's weight quantization, and that token padding changes nothing.
"""
import pytest
import torch

from megatron_calibclip.config import ConfigError, from_dict
from megatron_calibclip.fp8 import FP8Recipe
from megatron_calibclip.fp8.backend import run_backend
from megatron_calibclip.fp8.te import te_device_problem, te_environment_problem, te_token_multiple

H100 = (True, True, True)  # (CUDA, transformer-engine, torch._scaled_mm)
H100_NO_TE = (True, False, True)


def _config(**fp8):
    """A TE-shaped run as a user writes it (BF16 parameters, vLLM rollout), read on this CPU
    (where it resolves to our linears, so the TE checks are called directly below). Read
    with the megatron engine, then given vLLM's: the Python 3.12 leg has no vLLM to check."""
    from megatron_calibclip.trainer import TrainConfig

    cfg = from_dict(TrainConfig, {
        "model": {"params_dtype": "bf16"}, "precision": "fp8",
        "rollout": {"engine": "megatron", "precision": "bf16"},
        "fp8": {"format": "hybrid", "granularity": "blockwise", **fp8}})
    cfg.rollout.engine = "vllm"
    return cfg


def test_a_gpu_with_te_builds_te_and_one_without_builds_ours():
    from megatron_calibclip.trainer.te_run import trainer_backend

    fp8 = _config().fp8
    assert trainer_backend(fp8, machine=H100) == "te"
    assert trainer_backend(fp8, machine=H100_NO_TE) == "ours"
    assert trainer_backend(fp8) == "ours"  # this CPU: the emulation
    rowwise = _config(granularity="rowwise").fp8
    assert trainer_backend(rowwise, machine=H100) == "ours"  # auto: torch for what TE lacks


def test_what_te_cannot_express_is_refused_in_one_line_naming_the_alternative():
    for recipe, what in ((FP8Recipe(granularity="rowwise"), "rowwise"),
                         (FP8Recipe(linears=("fc1",)), "fp8.linears")):
        with pytest.raises(ConfigError) as err:
            run_backend("te", recipe, machine=H100)
        text = str(err.value)
        assert "\n" not in text and what in text and "'torch'" in text
        backend, why = run_backend("auto", recipe, machine=H100)
        assert backend == "torch" and "no TE recipe" in why
    assert run_backend("auto", FP8Recipe(granularity="blockwise"), machine=H100)[0] == "te"


def test_a_te_run_on_this_cpu_is_refused_in_one_line():
    from megatron_calibclip.trainer import TrainConfig

    with pytest.raises(ConfigError) as err:
        from_dict(TrainConfig, {"fp8": {"backend": "te"}})
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("fp8.backend: 'te' needs a CUDA device and transformer-engine")


HOPPER = ((9, 0), "12.9")


def _check_te_run(cfg, device):
    """te_run.check_te_run on the parts of `cfg` it reads, as TrainConfig's own check passes them."""
    from megatron_calibclip.trainer.te_run import check_te_run

    check_te_run(params_dtype=cfg.model.resolved_params_dtype(), rollout_engine=cfg.rollout.engine,
                 recipes_in_use=cfg.fp8_recipes_in_use(), device=device)


@pytest.mark.parametrize("fp8, change, device, message", [
    ({}, {"model.params_dtype": "fp32"}, HOPPER,
     "model.params_dtype: the Transformer Engine path runs BF16"),
    ({}, {"rollout.engine": "megatron"}, HOPPER, "rollout.engine: 'megatron' decodes with our own"),
    ({"granularity": "mxfp8"}, {}, HOPPER,
     "'mxfp8' needs compute capability >= 10.0; this GPU has 9.0"),
    ({}, {}, ((9, 0), "12.4"), "'blockwise' needs CUDA >= 12.9"),
    ({}, {}, ((10, 0), "12.9"), "'blockwise' runs on Hopper (9.x)"),
    ({"granularity": "tensorwise"}, {}, ((8, 0), "12.9"), "needs compute capability >= 8.9"),
])
def test_te_runs_that_cannot_start_are_refused_in_one_line(fp8, change, device, message):
    _check_te_run(_config(), device=HOPPER)  # the bundled H100 shape starts
    cfg = _config(**fp8)
    for path, value in change.items():
        section, field = path.split(".")
        setattr(getattr(cfg, section), field, value)
    with pytest.raises(ConfigError) as err:
        _check_te_run(cfg, device=device)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_te_scale_options_must_be_in_the_environment_te_starts_with(monkeypatch):
    """TE reads NVTE_FP8_BLOCK_SCALING_FP32_SCALES into Float8BlockScaling's defaults when it
    is imported; a recipe asking fp32 block scales without it would silently get powers of
    two."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    fp32_scales = FP8Recipe(granularity="blockwise", power_of_two_scales=False)
    assert te_environment_problem(FP8Recipe(granularity="blockwise")) is None
    problem = te_environment_problem(fp32_scales)
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in problem and "\n" not in problem
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert te_environment_problem(fp32_scales) is None
    assert "fp32 scales" in te_environment_problem(FP8Recipe(granularity="blockwise"))


def test_device_rules_follow_te_checks():
    assert te_device_problem(FP8Recipe(granularity="mxfp8"), (10, 0), "12.9") is None
    assert te_device_problem(FP8Recipe(granularity="tensorwise"), (8, 9), "12.1") is None
    assert "Hopper" in te_device_problem(FP8Recipe(granularity="mxfp8"), (9, 0), "12.9")


@pytest.mark.parametrize("granularity, tp, multiple", [
    ("tensorwise", 1, 16), ("blockwise", 2, 32), ("delayed", 4, 64), ("mxfp8", 1, 32),
    ("mxfp8", 2, 64)])
def test_token_multiple_is_megatrons_fp8_alignment_times_tp(granularity, tp, multiple):
    assert te_token_multiple(FP8Recipe(granularity=granularity), tp) == multiple


def test_the_te_spec_masks_causally_and_by_our_key_padding():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_calibclip.models import get_preset, local_layer_spec
    from megatron_calibclip.models.layer_specs import with_padding_causal_mask

    spec = local_layer_spec(get_preset("tiny"))
    masked = with_padding_causal_mask(spec)
    assert masked.submodules.self_attention.params["attn_mask_type"] == AttnMaskType.padding_causal
    assert spec.submodules.self_attention.params["attn_mask_type"] == AttnMaskType.causal  # a copy


def _standin_model(cfg):
    """A model built through the TE path's seams (TE-tagged spec, padding-causal mask) with
    megatron's local modules in place of TE's: what can run on a CPU."""
    from megatron_calibclip.models import build_policy_model, local_layer_spec
    from megatron_calibclip.models.layer_specs import with_padding_causal_mask

    spec = with_padding_causal_mask(local_layer_spec(cfg))
    spec.calibclip_backend = "te"
    model = build_policy_model(cfg, spec=spec, seed=0)
    assert model.calibclip_backend == "te"
    return model


def _shadow_body(rank, world_size, granularity):
    import megatron.core.transformer.transformer_block as block

    from megatron_calibclip.fp8 import precision, set_precision
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.parallel import model_parallel

    calls = []
    real = block.get_fp8_context

    def recording(config, layer_no=-1, is_init=False):
        calls.append((config.fp8, config.fp8_recipe, layer_no))
        return real(config, layer_no, is_init)

    block.get_fp8_context = recording
    try:
        with model_parallel():
            cfg = get_preset("tiny")
            model = _standin_model(cfg)
            te_linear = model.decoder.layers[0].self_attention.linear_qkv
            te_linear.is_first_microbatch = False  # as TE leaves it after a forward
            params = [id(p) for p in model.parameters()]
            tokens = torch.randint(1, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
            pos = torch.arange(16).expand(2, -1)
            set_precision(model, "fp8", FP8Recipe(format="hybrid", granularity=granularity))
            rearmed_on_entry = te_linear.is_first_microbatch
            te_linear.is_first_microbatch = False
            with torch.no_grad():
                model(tokens, pos, None)
                fp8_calls = list(calls)
                with precision(model, "bf16"):
                    config_fp8_in_shadow = model.config.fp8
                    model(tokens, pos, None)
                    shadow_calls = calls[len(fp8_calls):]
            return {"rearmed_on_entry": rearmed_on_entry,
                    "rearmed_after_shadow": te_linear.is_first_microbatch,
                    "fp8_calls": fp8_calls, "shadow_calls": shadow_calls,
                    "config_fp8_in_shadow": config_fp8_in_shadow,
                    "same_params": params == [id(p) for p in model.parameters()],
                    "layers": cfg.num_layers}
    finally:
        block.get_fp8_context = real


@pytest.mark.parametrize("granularity", ["blockwise", "delayed"])
def test_the_shadow_pass_switches_megatrons_fp8_context_off_on_the_same_module(dist_pool,
                                                                              granularity):
    res = dist_pool(1).run(_shadow_body, granularity)[0]
    # FP8: megatron's TransformerBlock asks its FP8 context with our recipe (delayed: once
    # around the block; the others: once per layer, layer_no = its global index)
    expected = [("hybrid", granularity, -1)] if granularity == "delayed" else \
        [("hybrid", granularity, n) for n in range(res["layers"])]
    assert res["fp8_calls"] == expected
    # the shadow pass: config.fp8 off, no FP8 context asked, the same parameters
    assert res["config_fp8_in_shadow"] is None and res["shadow_calls"] == []
    assert res["same_params"]
    # TE's cached FP8 weights are re-made when FP8 is entered (and re-entered after the shadow)
    assert res["rearmed_on_entry"] is True and res["rearmed_after_shadow"] is True


def _padding_body(rank, world_size):
    from megatron_calibclip.models import build_policy_model, get_preset, local_layer_spec
    from megatron_calibclip.parallel import model_parallel
    from megatron_calibclip.trainer.forward import compute_logprobs

    with model_parallel():
        cfg = get_preset("tiny")
        model = build_policy_model(cfg, spec=local_layer_spec(cfg), seed=0)
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(1, 1000, (3, 21), generator=gen)
        pad = torch.zeros(3, 21, dtype=torch.bool)
        pad[0, :5] = True  # a left-padded prompt
        tokens[0, :5] = 0
        mask = pad[:, None, None, :]
        kwargs = dict(vocab_size=cfg.vocab_size, temperature=1.0, micro_batch_size=2, pad_id=0,
                      with_entropy=True)
        plain = compute_logprobs(model, tokens, mask, **kwargs)
        seen = []
        hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
        model.calibclip_token_multiple = 16
        padded = compute_logprobs(model, tokens, mask, **kwargs)
        hook.remove()
        return plain, padded, seen


def test_token_padding_for_te_changes_no_log_prob(dist_pool):
    (lp, ent), (lp16, ent16), seen = dist_pool(1).run(_padding_body)[0]
    assert seen == [32, 32]  # 21 -> 32 columns, in both micro-batches
    assert lp.shape == lp16.shape == (3, 20)
    keep = torch.ones_like(lp, dtype=torch.bool)
    keep[0, :5] = False
    torch.testing.assert_close(lp16[keep], lp[keep], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent16[keep], ent[keep], rtol=0, atol=1e-5)


def test_once_te_is_imported_its_evaluated_defaults_decide(monkeypatch):
    """After megatron-core imported TE, the environment no longer matters: what TE's
    Float8BlockScaling class evaluated at import does (a stand-in module here)."""
    import sys
    import types

    qparams = types.SimpleNamespace(power_2_scale=False)  # TE imported with FP32_SCALES=1
    fake = types.ModuleType("transformer_engine.common.recipe")
    fake.Float8BlockScaling = type("Float8BlockScaling", (), {"fp8_quant_fwd_inp": qparams})
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", fake)
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    assert te_environment_problem(FP8Recipe(granularity="blockwise", power_of_two_scales=False)) is None
    assert "fp32 scales" in te_environment_problem(FP8Recipe(granularity="blockwise"))
