"""Run by tests/rollout/test_vllm_tp2.py under torchrun (2 ranks, fresh processes: vLLM's
parallel state is per process): the trainer at TP=2 and a vLLM engine with TP=2 (its own
TP = the trainer's), weights synced after each of several optimizer steps, log-probs compared
with the trainer's own vocab-parallel fp32 forward; greedy tokens with the megatron engine.
Writes one JSON file per rank into the folder given as argv[1]."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 3


def main(out: Path) -> None:
    from megatron_calibclip.checkpoint.hf_config import hf_config_from_model_config
    from megatron_calibclip.checkpoint.live_hf import hf_weight_buckets
    from megatron_calibclip.models import build_policy_model, forward_logits, get_preset
    from megatron_calibclip.models import shifted_logprobs_entropy
    from megatron_calibclip.models.layer_specs import emulated_layer_spec
    from megatron_calibclip.parallel import ParallelLayout, initialize_distributed, teardown
    from megatron_calibclip.rollout import MegatronRolloutEngine, SamplingParams
    from megatron_calibclip.rollout.vllm_engine import VllmRolloutEngine
    from megatron_calibclip.rollout.vllm_settings import VllmSettings
    from megatron_calibclip.trainer.rollout_factory import hf_tensor_count

    initialize_distributed(ParallelLayout(2, 1), seed=0)
    cfg = get_preset("tiny", num_attention_heads=2, num_query_groups=2)  # head_dim 32
    policy = build_policy_model(cfg, seed=5, spec=emulated_layer_spec(cfg))
    engine = VllmRolloutEngine(
        hf_config_from_model_config(cfg, torch.float32),
        VllmSettings(kv_cache_gb=0.05, max_num_seqs=16, timeout_s=600), precision="fp32",
        fp8_granularity="tensorwise", eos_id=999, pad_id=0, bos_id=None,
        weights=lambda: hf_weight_buckets(policy, cfg, 1 << 16),
        expected_tensors=hf_tensor_count(cfg), max_model_len=64, seed=0,
        device=torch.device("cpu"))
    prompts = [[5, 17, 99, 3], [8, 2], [400, 401, 402, 403, 404, 405], [7, 7, 7]]
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    steps = []
    for step in range(STEPS):
        engine.sync_weights()
        batch = engine.generate(prompts, SamplingParams(max_new_tokens=8), seed=step)
        logits = forward_logits(policy, batch.tokens, attention_mask=batch.attention_mask())
        lp, _ = shifted_logprobs_entropy(logits, batch.tokens, cfg.vocab_size)
        mask = batch.response_mask
        steps.append(float((lp.detach() - batch.rollout_logprobs)[mask].abs().max()))
        opt.zero_grad()
        (-(lp * mask).sum()).backward()
        opt.step()
    engine.sync_weights()
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    ours = MegatronRolloutEngine(policy, cfg.vocab_size, eos_id=999, pad_id=0)
    a, b = engine.generate(prompts, greedy, 0), ours.generate(prompts, greedy, 0)
    result = {"steps": steps, "greedy_equal": torch.equal(a.tokens, b.tokens),
              "greedy_lp": float((a.rollout_logprobs - b.rollout_logprobs)[a.response_mask]
                                 .abs().max())}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    teardown()  # shuts vLLM down first (before_teardown), then our groups: no error at exit


if __name__ == "__main__":
    main(Path(sys.argv[1]))
