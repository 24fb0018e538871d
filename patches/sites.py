"""What the CPU patches rely on in megatron-core 0.16.1: the functions holding CUDA-only call
sites (per proxied module), the functions replaced or wrapped outright, and a fingerprint of
each one's source. tests/test_patches.py compares them with the installed megatron-core;
tools/patch_fingerprints.py prints fresh tables after a version change."""
from __future__ import annotations

MADE_FOR_MEGATRON_CORE = "0.16.1"

# Modules whose global name `torch` is replaced by the proxy, and in each the functions
# (qualified names) holding the CUDA-only call sites. These are the fingerprinted sites.
PROXIED_MODULES: dict[str, list[str]] = {
    "megatron.core.tensor_parallel.random": [
        "_get_cuda_rng_state",
        "_set_cuda_rng_state",
        "CudaRNGStatesTracker.add",
        "model_parallel_cuda_manual_seed",
    ],
    "megatron.core.tensor_parallel.mappings": [
        "_gather_along_last_dim",
        "_gather_along_first_dim",
        "_reduce_scatter_along_first_dim",
        "_AllToAll.forward",
    ],
    "megatron.core.tensor_parallel.layers": [
        "VocabParallelEmbedding.__init__",
        "LinearWithGradAccumulationAndAsyncCommunication.backward",
        "ColumnParallelLinear.__init__",
        "RowParallelLinear.__init__",
    ],
    "megatron.core.utils": [
        "GlobalMemoryBuffer.get_tensor",
        # not on our code paths (symmetric memory, DP hash checks, multi-tensor l2 norm
        # fallback, straggler detector, hybrid CP); listed so that changes are noticed
        "GlobalSymmetricMemoryBuffer.__init__",
        "check_param_hashes_across_dp_replicas",
        "local_multi_tensor_l2_norm",
        "StragglerDetector.configure",
        "StragglerDetector.elapsed",
        "get_batch_on_this_hybrid_cp_rank",
    ],
    "megatron.core.models.common.embeddings.rotary_pos_embedding": [
        "RotaryEmbedding.__init__",
        "RotaryEmbedding.get_emb",
        "MultimodalRotaryEmbedding.__init__",
    ],
    "megatron.core.pipeline_parallel.p2p_communication": [
        "P2PCommunicator._communicate_shapes",
        "P2PCommunicator._communicate",
    ],
    "megatron.core.pipeline_parallel.schedules": [
        "forward_step",  # only torch.autocast("cuda") when config.enable_autocast (keep off)
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_with_interleaving",
        "forward_backward_pipelining_without_interleaving",
    ],
    "megatron.core.transformer.utils": [
        "get_default_causal_mask",
        "get_sliding_window_causal_mask",
    ],
    "megatron.core.optimizer.clip_grads": [
        "get_grad_norm_fp32",
        "clip_grad_by_total_norm_fp32",
        "count_zeros_fp32",
    ],
    "megatron.core.models.gpt.gpt_model": ["GPTModel._preprocess"],
    "megatron.core.transformer.attention": ["Attention._allocate_memory"],
    # megatron's optimizers (loss-scale tensors) and checkpoint helpers used by the trainer
    "megatron.core.optimizer.optimizer": [
        "MegatronOptimizer.restore_from_cpu",
        "MixedPrecisionOptimizer.__init__",
        "FP32Optimizer.__init__",
        "ChainedOptimizer.get_loss_scale",
    ],
    "megatron.core.optimizer.distrib_optimizer": [
        "DistributedOptimizer.load_state_dict",
        "DistributedOptimizer.get_parameter_state_dp_zero",
    ],
    # megatron's DDP (grad buffers, finalize_model_grads) used by the trainer
    # (communication streams are used only with overlap_grad_reduce, which stays off on CPU)
    "megatron.core.distributed.param_and_grad_buffer": ["_ParamAndGradBuffer.__init__"],
    "megatron.core.distributed.distributed_data_parallel": [
        "DistributedDataParallel.__init__",
        "DistributedDataParallel.offload_grad_buffers",
        "DistributedDataParallel.restore_grad_buffers",
    ],
}

# Functions replaced or wrapped outright.
REPLACED_FUNCTIONS = [
    # these compare `tensor.type()` with 'torch.cuda.FloatTensor'; they run with CPU tensors
    # reporting their CUDA type name (see _cpu_reports_cuda_type)
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.models.common.language_module.language_module:"
    "LanguageModule.setup_embeddings_and_output_layer",
]


def all_patched_sites() -> list[str]:
    """Every megatron function whose source the patches rely on, as 'module:qualname'."""
    sites = [f"{m}:{f}" for m, fns in PROXIED_MODULES.items() for f in fns]
    return sites + list(REPLACED_FUNCTIONS)


# Fingerprints of the functions above in megatron-core 0.16.1 (tools/patch_fingerprints.py).
FINGERPRINTS: dict[str, str] = {
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": "0c2b8f05b864739e",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": "dea947ca0b7dc92b",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.add": "c7b54631963881cc",
    "megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed": "8299b7e2c399ea2f",
    "megatron.core.tensor_parallel.mappings:_gather_along_last_dim": "afce19cdeb8f2473",
    "megatron.core.tensor_parallel.mappings:_gather_along_first_dim": "abaaf454b5e09149",
    "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim": "09ac896729369d2d",
    "megatron.core.tensor_parallel.mappings:_AllToAll.forward": "36aa19f1e31da17e",
    "megatron.core.tensor_parallel.layers:VocabParallelEmbedding.__init__": "67fa488ec48039a6",
    "megatron.core.tensor_parallel.layers:LinearWithGradAccumulationAndAsyncCommunication.backward": "811da15f04b42d72",
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear.__init__": "7c3a8e3b79e9bbc2",
    "megatron.core.tensor_parallel.layers:RowParallelLinear.__init__": "5a23d4a1bd458e34",
    "megatron.core.utils:GlobalMemoryBuffer.get_tensor": "40f2edef1c66f1a5",
    "megatron.core.utils:GlobalSymmetricMemoryBuffer.__init__": "b76eace4e1a151b8",
    "megatron.core.utils:check_param_hashes_across_dp_replicas": "58ac191bfe316299",
    "megatron.core.utils:local_multi_tensor_l2_norm": "128bb632d77616dc",
    "megatron.core.utils:StragglerDetector.configure": "f11d704cb995a933",
    "megatron.core.utils:StragglerDetector.elapsed": "47e72a4fe8d22028",
    "megatron.core.utils:get_batch_on_this_hybrid_cp_rank": "6dae5a7597c1a4f9",
    "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.__init__": "a90792e84777f23b",
    "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb": "09f87c7582f023bc",
    "megatron.core.models.common.embeddings.rotary_pos_embedding:MultimodalRotaryEmbedding.__init__": "ba1108f5241ef309",
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate_shapes": "02c505710bc2e4cb",
    "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate": "96baed651678bc59",
    "megatron.core.pipeline_parallel.schedules:forward_step": "29632237be2cf108",
    "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining": "e1aee81a7cb9ae19",
    "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving": "98a064cf490d2a19",
    "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving": "988e50158aeb474f",
    "megatron.core.transformer.utils:get_default_causal_mask": "510d896df7d6deca",
    "megatron.core.transformer.utils:get_sliding_window_causal_mask": "116b3ed3a8519ddf",
    "megatron.core.optimizer.clip_grads:get_grad_norm_fp32": "3ab7a7bbb25c84d7",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32": "d2d28092dcb2066f",
    "megatron.core.optimizer.clip_grads:count_zeros_fp32": "1fd2a2cc17103420",
    "megatron.core.models.gpt.gpt_model:GPTModel._preprocess": "c107f8e8f17cb56f",
    "megatron.core.transformer.attention:Attention._allocate_memory": "7fba838b541b5220",
    "megatron.core.optimizer.optimizer:MegatronOptimizer.restore_from_cpu": "e19e0656940e9cd8",
    "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.__init__": "5e17162e19b3c4e7",
    "megatron.core.optimizer.optimizer:FP32Optimizer.__init__": "d950fcfafebeab97",
    "megatron.core.optimizer.optimizer:ChainedOptimizer.get_loss_scale": "cf7d1cf031b3f78e",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict": "393f78388da771d3",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero": "6b5a766d0fee9570",
    "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__": "500069dac412f151",
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.__init__": "031b2185fccd63b5",
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.offload_grad_buffers": "8da7d51fa5b68ae7",
    "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.restore_grad_buffers": "eda77f9d9448fa5d",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups": "e09973947a7f21da",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__": "c806fd0848fa4ce7",
    "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer": "e2c7af37cedcf258"
}
