"""Process groups and vocab-parallel math (floor 1)."""


def teardown_model_parallel() -> None:
    """Destroy megatron's model-parallel groups if they exist (placeholder until init lands)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
