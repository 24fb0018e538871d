"""GPT builders and layer specs for the policy and the reference model (floor 2)."""
from megatron_calibclip.models.builder import (
    build_gpt_model,
    build_policy_model,
    build_reference_model,
    copy_weights,
    place_on_device,
    to_transformer_config,
)
from megatron_calibclip.models.forward import (
    forward_logits,
    position_ids_for,
    shifted_logprobs_entropy,
)
from megatron_calibclip.models.config import PRESETS, ModelConfig, get_preset
from megatron_calibclip.models.layer_specs import (
    emulated_layer_spec,
    layer_spec,
    local_layer_spec,
    te_layer_spec,
)

__all__ = [
    "PRESETS",
    "ModelConfig",
    "build_gpt_model",
    "build_policy_model",
    "build_reference_model",
    "copy_weights",
    "emulated_layer_spec",
    "forward_logits",
    "position_ids_for",
    "shifted_logprobs_entropy",
    "get_preset",
    "layer_spec",
    "local_layer_spec",
    "te_layer_spec",
    "place_on_device",
    "to_transformer_config",
]
