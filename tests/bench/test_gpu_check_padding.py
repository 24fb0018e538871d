"""gpu_check's `padding` case (section f on a GPU) run on the CPU through the TE stand-in,
which reads a padding mask as cuDNN does (lengths, valid columns [0, len)): the trainer's
path passes, and the same batch fed to the model left-padded, as the trainer did before
issue 37's fix, is far off, so the case can see the bug it is there for. The torch-mask
(emulated) spec reads left padding correctly either way: its `unfixed` figure stays small."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.te_stand_in, pytest.mark.dist]


def _body(rank, world_size, spec):
    from megatron_calibclip.bench.gpu_check.padding import check_padding
    from megatron_calibclip.models import build_policy_model, get_preset
    from megatron_calibclip.models.layer_specs import emulated_layer_spec
    from megatron_calibclip.models.te_stand_in import te_stand_in_layer_spec
    from megatron_calibclip.parallel import model_parallel

    with model_parallel():
        cfg = get_preset("tiny-qwen3")
        layer_spec = te_stand_in_layer_spec(cfg) if spec == "cudnn-stand-in" else \
            emulated_layer_spec(cfg)
        model = build_policy_model(cfg, seed=0, spec=layer_spec)
        model.eval()
        return check_padding(model, cfg, width=24, device="cpu")


@pytest.mark.parametrize("spec", ["cudnn-stand-in", "torch-mask"])
def test_stand_in_padding_case_passes_and_sees_the_left_padding_bug(dist_pool, spec):
    from megatron_calibclip.bench.gpu_check.padding import THRESHOLDS

    out = dist_pool(1).run(_body, spec)[0]
    assert out["ran"] and out["passed"], out
    assert out["padded_vs_alone"]["max"] <= 1e-5  # fp32 on the CPU: far inside the bound
    if spec == "cudnn-stand-in":
        assert out["unfixed_vs_alone"]["mean"] > 10 * THRESHOLDS["mean_abs_logprob_diff"], out
    else:
        assert out["unfixed_vs_alone"]["max"] <= 1e-5, out
