"""The memory planner: hand-computed bytes, published figures, monotonicity, the recipes."""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_calibclip.config import ConfigError
from megatron_calibclip.models.config import get_preset
from megatron_calibclip.planner import crosscheck
from megatron_calibclip.planner.activations import for_model, paper_gpt
from megatron_calibclip.planner.cli import add_plan_parser
from megatron_calibclip.planner.memory import estimate
from megatron_calibclip.planner.params import stage_params, total_params
from megatron_calibclip.planner.recipe import read_recipe, sbatch_header
from megatron_calibclip.planner.search import plan, recommend
from megatron_calibclip.planner.spec import Hardware, Layout, Workload
from megatron_calibclip.planner.states import bytes_per_param

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "launch" / "recipes").glob("*.yaml"))


# --- hand-computed: the tiny preset (2 layers, h 64, FFN 128, 4 heads / 2 KV groups of 16,
# vocabulary 1000, tied embeddings) ------------------------------------------------------------

TINY_LAYER_LINEAR = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # QKV + proj + gate/up/down
TINY_PARAMS = 2 * (TINY_LAYER_LINEAR + 2 * 64) + 1000 * 64 + 64  # layers + embedding + norm


def test_tiny_parameters_by_hand():
    m = get_preset("tiny")
    assert TINY_LAYER_LINEAR == 36864 and TINY_PARAMS == 138048
    s = stage_params(m, 1, 1, 0)
    assert (s.linear, s.total) == (2 * TINY_LAYER_LINEAR, TINY_PARAMS)
    assert total_params(m) == m.num_parameters() == TINY_PARAMS
    # TP=2: linear weights and the embedding are split, the norms are replicated; the
    # vocabulary is padded to a multiple of 8 (the preset's divisor) x TP = 16: 1008
    s2 = stage_params(m, 2, 1, 0)
    assert s2.linear == TINY_LAYER_LINEAR and s2.other == 2 * 128 + 1008 * 64 // 2 + 64


def test_tiny_memory_by_hand():
    m = get_preset("tiny")
    lay = Layout(tp=1, pp=1, dp=2, distributed_optimizer=True, precision="fp8")
    w = Workload(seq_len=128, prompt_len=32, micro_batch=2, logprob_micro_batch=4,
                 rollout_batch=4, microbatches_per_step=4)
    st = estimate(m, lay, w).stages[0]
    n, lin = TINY_PARAMS, 2 * TINY_LAYER_LINEAR
    assert st.states.weights == 2 * n  # BF16
    assert st.states.fp8_caches == 2 * lin  # FP8 copy + transpose of linear weights
    assert st.states.grads == 4 * n  # FP32 main gradients
    assert st.states.optimizer == 12 * n / 2  # master + Adam m, v, sharded over DP=2
    assert st.states.reference == 2 * n
    # one layer, FP8 GEMM inputs, bytes per token: norm inputs 2h + 2h, GEMM inputs h + h
    # (QKV, FC1), Q/K/V 2 x (64 + 2 x 32), log-sum-exp 4 x 4 heads, proj input 64 (FP8)
    # plus flash output 128 (BF16), SwiGLU input 4 x 128, FC2 input 128 (FP8)
    per_token = 128 + 64 + 256 + 16 + 64 + 128 + 128 + 64 + 512 + 128
    assert per_token == 1488
    assert for_model(m, "fp8").bytes(1, 1, 1, False) == per_token
    bf16 = 128 + 128 + 256 + 16 + 128 + 128 + 128 + 512 + 256  # GEMM inputs in 2 bytes
    assert for_model(m, "bf16").bytes(1, 1, 1, False) == bf16
    layers = 2 * per_token * 128 * 2  # 2 layers, s=128, b=2, 1 micro-batch in flight (PP=1)
    output = 4 * 64 * 256 + 10 * 256 * 1000  # final norm + output input; logits 2+4+4 B
    assert st.update == layers + output
    assert st.logprobs == per_token * 128 * 4 + 4 * 64 * 512 + 10 * 512 * 1000
    kv = 2 * 2 * 2 * 16 * 2 * 4 * 128  # K,V x layers x groups x head dim x BF16 x seqs x tokens
    assert st.kv_cache == kv
    assert st.generation == kv + per_token * 32 * 4 + 2 * 4 * 32 * 1000  # + prefill logits
    static = 2 * n + 2 * lin + 4 * n + 6 * n + 2 * n
    assert st.peak == static + st.logprobs and st.peak_phase == "log-probs"


def test_bytes_per_parameter_match_megatron_and_zero():
    # Megatron's distributed-optimizer table: bf16 params + fp32 grads -> 18 / 6 + 12/d
    assert bytes_per_param(Layout(dp=8, distributed_optimizer=False)) == 18
    assert bytes_per_param(Layout(dp=8, distributed_optimizer=True)) == 6 + 12 / 8
    # ZeRO: 16-bit weights and gradients -> 2 + 2 + 12 (K = 12)
    assert bytes_per_param(Layout(dp=64, distributed_optimizer=False, grad_dtype="bf16")) == 16


def test_paper_formulas_are_reproduced_exactly():
    h, a, s, b, t = 12288, 96, 2048, 1, 8
    layer, sbh = paper_gpt(h, a), s * b * h
    assert layer.bytes(s, b, 1, False) == sbh * 34 + 5 * a * s * s * b
    assert layer.bytes(s, b, t, False) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert layer.bytes(s, b, t, True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert layer.bytes(s, b, t, True, "selective") == pytest.approx(34 * sbh / t)
    assert layer.bytes(s, b, t, True, "full") == pytest.approx(2 * sbh / t)


def test_published_figures():
    checks = {c.name: c for c in crosscheck.all_checks()}
    for c in checks.values():
        if c.source in (crosscheck.ZERO, crosscheck.KORTHIKANTI) or "estimator" in c.name \
                or "parameters" in c.name:
            assert abs(c.error_pct) < 0.1, (c.name, c.published, c.ours)
    measured = checks["Llama-3 8B memory allocated between iterations (measured)"]
    # the planner is conservative on this measurement, by less than a fifth
    assert 0 < measured.error_pct < 20
    assert "source:" in crosscheck.table(list(checks.values()))


# --- monotonicity ------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["llama3-8b", "qwen3-8b", "qwen3-14b", "qwen2.5-32b",
                                    "qwen3-32b"])
@pytest.mark.parametrize("sp", [False, True])
def test_more_tensor_parallelism_means_less_memory_per_gpu(preset, sp):
    m = get_preset(preset)
    w = Workload(seq_len=8192, prompt_len=1024, rollout_batch=32)
    prev = None
    for tp in (1, 2, 4, 8):
        e = estimate(m, Layout(tp=tp, pp=1, dp=4, sequence_parallel=sp), w).stages[0]
        now = (e.states.policy + e.states.reference, e.update, e.logprobs, e.kv_cache, e.peak)
        if prev is not None:
            assert all(b < a for a, b in zip(prev, now)), (tp, prev, now)
        prev = now


def test_more_pipeline_stages_means_fewer_states_per_gpu():
    m, w = get_preset("qwen3-32b"), Workload()
    states = [estimate(m, Layout(tp=8, pp=pp, dp=1), w).worst.static for pp in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and len(set(states)) == 4


def test_distributed_optimizer_and_offload_and_recompute_each_save_memory():
    m, w = get_preset("qwen3-14b"), Workload(seq_len=8192)
    base = Layout(tp=4, pp=1, dp=4, distributed_optimizer=False)
    ref = estimate(m, base, w).stages[0]
    assert estimate(m, replace(base, distributed_optimizer=True), w).stages[0].states.optimizer \
        == ref.states.optimizer / 4
    assert estimate(m, replace(base, offload_reference=True), w).stages[0].static \
        < ref.static
    upd = [estimate(m, replace(base, recompute=r), w).stages[0].update
           for r in ("none", "selective", "full")]
    assert upd[0] > upd[1] > upd[2]


# --- search and recipes ------------------------------------------------------------------------

def test_search_lists_only_valid_layouts_and_recommends_a_fitting_one():
    m = get_preset("qwen3-32b")
    estimates = plan(m, 32, Workload(seq_len=8192, rollout_batch=32))
    for e in estimates:
        assert e.layout.tp * e.layout.pp * e.layout.dp == 32
        assert e.layout.tp <= 8 and 8 % e.layout.tp == 0  # KV groups, within a node
    best = recommend(estimates)
    assert best is not None and best.fits
    assert recommend(plan(m, 1, Workload())) is None  # 32B does not fit on one GPU


def test_sbatch_header_is_read_from_a_recipe(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("# title\n# sbatch: --nodes=3 --gpus-per-node=8 --time=1:00:00\nrun: {}\n")
    assert sbatch_header(p) == ["--nodes=3", "--gpus-per-node=8", "--time=1:00:00"]


def test_recipes_cover_8b_14b_32b_with_grpo_and_dapo():
    names = {p.stem for p in RECIPES}
    assert {f"qwen3-{s}-{a}" for s in ("8b", "14b", "32b") for a in ("grpo", "dapo")} <= names
    assert read_recipe(REPO / "launch/recipes/qwen3-8b-grpo.yaml").nodes == 1
    assert read_recipe(REPO / "launch/recipes/qwen3-14b-dapo.yaml").nodes > 1
    assert read_recipe(REPO / "launch/recipes/qwen3-32b-dapo.yaml").nodes > 1


def test_the_32b_recipe_fits_in_80gb():
    r = read_recipe(REPO / "launch" / "recipes" / "qwen3-32b-dapo.yaml")
    e = estimate(get_preset(r.preset), r.layout, r.workload, Hardware())
    assert r.preset == "qwen3-32b" and e.fits, (e.peak_gib, e.headroom_gib)
    assert e.peak_gib + e.hardware.reserve_gib <= 80


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_fits_and_is_the_planners_choice(recipe):
    r = read_recipe(recipe)
    m = get_preset(r.preset)
    hw = Hardware(gpus_per_node=r.gpus_per_node)
    e = estimate(m, r.layout, r.workload, hw)
    assert e.fits, f"{recipe.name}: {e.peak_gib:.1f} GiB peak"
    best = recommend(plan(m, r.gpus, r.workload, hw, r.layout, recompute=("none",)))
    chosen = (r.layout.tp, r.layout.pp, r.layout.offload_reference)
    assert (best.layout.tp, best.layout.pp, best.layout.offload_reference) == chosen, (
        f"{recipe.name}: re-plan it, the planner now recommends {best.layout.describe()}")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_is_a_valid_train_config(recipe):
    from megatron_calibclip.cli import load_train_config

    # the recipes roll out FP8 on vLLM, which this CPU cannot (one line at config time);
    # the rest of the config is checked with the megatron engine
    with pytest.raises(ConfigError, match=r"rollout\.(engine|precision): .*vllm"):
        load_train_config(str(recipe), [])
    cfg = load_train_config(str(recipe), ["rollout.engine=megatron"])
    assert cfg.run.name == recipe.stem and cfg.precision == "fp8"
    assert cfg.algorithm.prompts_per_step % read_recipe(recipe).layout.dp == 0
    assert read_recipe(recipe).layout.rollout_engine == "vllm"


def test_the_recipes_are_the_bundled_configs():
    """One copy of each H100 recipe: launch/recipes/ links to the package's configs."""
    for recipe in RECIPES:
        assert recipe.is_symlink(), recipe
        assert recipe.resolve() == REPO / "megatron_calibclip" / "configs" / recipe.name


H100 = (True, True, True)  # (CUDA, transformer-engine, torch._scaled_mm) with the gpu extra


def _recipe_as_on_an_h100(recipe):
    """The recipe as the config check reads it on an H100 node: loaded here with the megatron
    engine (the CPU refuses vLLM's FP8 rollout when a config is read), then given back its
    vLLM rollout, and `params_dtype: auto` resolved as on CUDA."""
    from megatron_calibclip.cli import load_train_config

    cfg = load_train_config(str(recipe), ["rollout.engine=megatron"])
    cfg.rollout.engine = "vllm"
    assert cfg.model.params_dtype in ("auto", "bf16")
    cfg.model.params_dtype = "bf16"
    return cfg


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_can_run_on_an_h100(recipe, monkeypatch):
    """With the gpu extra the trainer builds megatron's TE spec for the recipe, TE expresses
    it, and the run starts on Hopper (compute capability 9.0, CUDA 12.9), in the environment
    launch/train.sbatch gives it (`calibclip te-env`: fp8/te.py te_environment)."""
    from megatron_calibclip.fp8 import te_environment
    from megatron_calibclip.fp8.backend import check_backend_supports, run_backend
    from megatron_calibclip.trainer.te_run import check_te_run, trainer_backend

    cfg = _recipe_as_on_an_h100(recipe)
    for name, value in te_environment(cfg.fp8).items():
        monkeypatch.setenv(name, value)
    backend, why = run_backend(cfg.fp8.backend, cfg.fp8, machine=H100)
    assert backend == "te", why
    check_backend_supports(backend, cfg.fp8.granularity)
    assert trainer_backend(cfg.fp8, machine=H100) == "te"
    check_te_run(params_dtype=cfg.model.resolved_params_dtype(), rollout_engine=cfg.rollout.engine,
                 recipes_in_use=cfg.fp8_recipes_in_use(), device=((9, 0), "12.9"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_without_te_an_h100_recipe_is_refused_in_one_line_naming_the_gpu_extra(recipe):
    """Without transformer-engine `auto` takes torch._scaled_mm, whose block-scaled GEMMs are
    not wired: the config check says so, and how to get TE, in one line."""
    from megatron_calibclip.fp8.backend import check_backend_supports, run_backend

    cfg = _recipe_as_on_an_h100(recipe)
    backend, _ = run_backend(cfg.fp8.backend, cfg.fp8, machine=(True, False, True))
    assert backend == "torch"
    with pytest.raises(ConfigError) as err:
        check_backend_supports(backend, cfg.fp8.granularity)
    assert "--no-build-isolation" in str(err.value) and "\n" not in str(err.value)


# --- command line ------------------------------------------------------------------------------

def _run(argv):
    parser = argparse.ArgumentParser(prog="calibclip")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def test_cli(capsys):
    assert _run(["--model", "qwen3-32b", "--gpus", "32", "--seq", "8192",
                 "--rollout-batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "optimizer" in out and "KV cache" in out
    assert _run(["--model", "qwen3-32b", "--gpus", "1"]) == 1
    assert _run(["--model", "nope", "--gpus", "8"]) == 2
    assert "nope" in capsys.readouterr().err
    assert _run(["--recipe", str(REPO / "launch/recipes/qwen3-32b-dapo.yaml")]) == 0
    assert _run(["--crosscheck"]) == 0
    assert "arXiv:2205.05198" in capsys.readouterr().out


def test_cli_nothing_fits_lists_the_layouts_and_what_would_fit(capsys):
    assert _run(["--model", "qwen3-32b", "--gpus", "7"]) == 1
    out = capsys.readouterr().out
    assert "nothing fits on 7 GPUs" in out
    # the four layouts 7 GPUs allow: TP x PP x DP = 1x7x1 and 1x1x7, reference resident/offloaded
    assert out.count("\n  1   7    1") == 2 and out.count("\n  1   1    7") == 2
    line = next(x for x in out.splitlines() if "GPUs as asked:" in x)
    gpus = int(line.split()[0])
    # independent check with the search itself: the smallest count (multiples of 8) that fits
    workload = Workload(seq_len=4096, prompt_len=1024, micro_batch=1, logprob_micro_batch=4,
                        rollout_batch=64, microbatches_per_step=8)
    base = Layout(sequence_parallel=False)
    fits = [g for g in range(8, 65, 8)
            if recommend(plan(get_preset("qwen3-32b"), g, workload, Hardware(), base, "qwen3-32b",
                              recompute=("none",)))]
    assert gpus == fits[0]


def test_cli_zero_gpus_has_its_own_message(capsys):
    assert _run(["--model", "qwen3-32b", "--gpus", "0"]) == 2
    assert "--gpus must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, rule", [("--gpu-memory-gib", "-5", "> 0"),
                                               ("--reserve-gib", "-1", ">= 0"),
                                               ("--gpus-per-node", "0", ">= 1")])
def test_cli_bad_hardware_is_one_line(capsys, flag, value, rule):
    assert _run(["--model", "qwen3-8b", "--gpus", "8", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and rule in err, err


def test_save_memory_per_optimizer_format_by_hand():
    """planner/save.py against the byte counts read in megatron's source (its docstring), for
    1e9 parameters on a GPU at DP=4 with bf16 policy and reference: weights 2 + 2 B, the
    optimizer 12 B per parameter for the whole TP x PP shard."""
    from megatron_calibclip.checkpoint.optimizer_format import OPTIMIZER_FORMATS as CHECKPOINT_FORMATS
    from megatron_calibclip.planner.params import StageParams
    from megatron_calibclip.planner.save import OPTIMIZER_FORMATS, save_memory
    from megatron_calibclip.planner.spec import Layout

    assert OPTIMIZER_FORMATS == CHECKPOINT_FORMATS
    p = StageParams(stage=0, layers=1, linear=900_000_000, other=100_000_000)
    lay = Layout(tp=1, pp=1, dp=4, distributed_optimizer=True)
    dp_res = save_memory(p, lay, "dp_reshardable")
    assert (dp_res.written, dp_res.staged_host, dp_res.gather_host, dp_res.gather_gpu) == (
        16e9, 4e9 + 3e9, 0, 0)
    full = save_memory(p, lay, "fully_reshardable")
    assert (full.staged_host, full.gather_host) == (4e9, 12e9)
    assert full.gather_gpu == 4 * 40_000_000 * 1.25  # one bucket's receive + send buffers
    lean = save_memory(p, lay, "fully_reshardable_mem_efficient")
    assert (lean.host_peak, lean.gather_gpu) == (16e9, 0)
    plain = save_memory(p, Layout(dp=4, distributed_optimizer=False, params_dtype="fp32"))
    assert (plain.format, plain.staged_host) == ("plain", (4 + 2 + 8) * 1e9)
