"""Column/RowParallelLinear whose GEMMs are emulated in BF16 or FP8, switchable per model.

Why subclasses that override only `_forward_impl`: megatron's forward keeps doing the tensor-
parallel communication (column: copy-to-TP-region / all-reduce of the input gradient, optional
output gather; row: input already split, reduce-from-TP-region of the output), so the TP
semantics cannot drift; only the local GEMM changes. Same constructor, so the layer spec
takes them as they are. In "fp32" mode the parent's GEMM runs untouched (bit-identical to
the plain local spec).

The emulated GEMM does what the hardware does, in fp32 on CPU:
- bf16: operands (input, weight, bias) rounded to bf16, fp32 accumulation, output rounded to
  bf16 (tensor cores).
  Backward: output gradient rounded to bf16; dgrad rounded to bf16; wgrad kept in fp32
  (megatron accumulates it into an fp32 main_grad).
- fp8: the bf16 input and the weight (its bf16 copy under weight_source "bf16", the
  default, as TE quantizes it with fp8_param off; the fp32 master under "fp32") quantized
  per the recipe (scales per TP shard: each rank sees only its shard, as each GPU would),
  product of the dequantized values accumulated in fp32, output rounded to bf16. The
  weight's operands (its bf16 copy, its FP8 codes, its dgrad copy) are computed once and
  reused until the master weight changes (fp8/weight_cache.py, as TE caches FP8 weights
  between micro-batches). Backward, as Transformer Engine: the output gradient is quantized
  (E5M2 under "hybrid"; delayed scaling records its amax once per backward), dgrad uses the
  weight quantized along the output dim, wgrad the gradient and the input quantized along
  the token dim (the input's copy saved from the forward); with fp8_wgrad off the wgrad is a
  BF16 GEMM.
- fp8.backend "torch": the same three GEMMs are real FP8 GEMMs (torch._scaled_mm,
  fp8/scaled_mm.py) on the same codes and scales: forward x . W, dgrad dY . W^T-copy,
  wgrad dY^T . X^T-copy, every operand quantized along its GEMM's reduction dim, so rowwise
  scales are always along the axis _scaled_mm needs and no GEMM falls back to the
  emulation; only a BF16 wgrad (fp8_wgrad off) stays the emulation's BF16 GEMM. On the CPU
  (no AMX) torch's _scaled_mm dequantizes and multiplies as the emulation does, so the
  backends agree bit for bit (tests/fp8/test_backend.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_calibclip.fp8 import native as native_kernels
from megatron_calibclip.fp8.backend import check_backend_supports, linear_backend
from megatron_calibclip.fp8.delayed import AmaxHistory, PendingAmaxError
from megatron_calibclip.fp8.formats import round_to_bf16
from megatron_calibclip.fp8.gemm import gemm_path
from megatron_calibclip.fp8.linear_gemm import _Gemm, _q, _qd, _state
from megatron_calibclip.fp8.linear_native import native_backward, native_forward
from megatron_calibclip.fp8.precision import PrecisionState, rounds_activations
from megatron_calibclip.fp8.quantize import Quantized, quantize, quantize_dequantize, same_both_ways
from megatron_calibclip.fp8.recipe import ROLE_VALUES, FP8Recipe
from megatron_calibclip.fp8.scaled_mm import Fp8Operand, fp8_gemm, fp8_operand, scaled_mm
from megatron_calibclip.fp8.weight_cache import WeightCache


OUTPUT_LAYER_NAME = "output"  # the bf16 output layer (models/bf16_stack.py); never FP8


def _transposed_copy(t: torch.Tensor, tq: torch.Tensor, recipe, role: str) -> torch.Tensor:
    """The operand of the transposed GEMM: TE quantizes each GEMM's copy along that GEMM's
    reduction dimension, which differs from the forward copy `tq` unless the scaling is the
    same both ways (tensorwise/delayed, or blocks symmetric in both axes)."""
    return tq if same_both_ways(recipe, role) else quantize_dequantize(t, recipe, role, axis=0)


def _wgrad_operand(t: torch.Tensor, tq: torch.Tensor, recipe, role: str) -> torch.Tensor:
    """Activation or gradient as the weight-gradient GEMM reads it (BF16 if fp8_wgrad is off)."""
    return _transposed_copy(t, tq, recipe, role) if recipe.fp8_wgrad else round_to_bf16(t)


def _wgrad_fp8(t: torch.Tensor, q: Quantized, recipe, role: str) -> Fp8Operand:
    """The torch backend's FP8 wgrad operand: the same copy as `_transposed_copy` (quantized
    along the token dim, the wgrad's reduction dim), as codes [features, tokens]."""
    tq = q if same_both_ways(recipe, role) else quantize(t, recipe, role, axis=0)
    return fp8_operand(tq, 0, recipe.granularity)


class _EmulatedLinearFunction(torch.autograd.Function):
    """y = x W^T (+ b) with emulated operand rounding; TP dgrad all-reduce as megatron's."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemm: _Gemm, allreduce_dgrad: bool, tp_group):
        # a bf16 stack hands the GEMM bf16 inputs and the bf16 copy of the weight and bias
        # (a BF16 GEMM always does; an FP8 one unless activation_precision is "fp32")
        bf16_io = gemm.mode == "bf16" or gemm.recipe.activation_precision == "bf16"
        x2 = x.reshape(-1, x.shape[-1]).float()
        if bf16_io and not (gemm.native and gemm.mode == "bf16"):  # (native bf16: casts itself)
            x2 = round_to_bf16(x2)
        b = bias.float() if bias is not None else None
        b = round_to_bf16(b) if (b is not None and bf16_io) else b
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_for_wgrad = w_for_dgrad = None
        x_fp8 = w_fp8 = Fp8Operand(None, None)  # the torch backend's wgrad / dgrad operands
        ctx.native = None
        if gemm.native:  # BF16 kernels on the bf16 copies / FP8 codes (fp8/linear_native.py)
            out, ctx.native = native_forward(x2, weight, b, gemm, need_dgrad, need_wgrad,
                                             bf16_io)
        elif gemm.mode == "bf16":
            wf = gemm.weights.operands(weight, None).forward_copy
            out = x2 @ wf.t()
            x_for_wgrad, w_for_dgrad = x2, wf
        else:
            recipe = gemm.recipe
            if gemm.backend == "torch":  # real FP8 GEMMs on the same codes and scales
                qx = _q(x2, gemm, "activation", -1)
                ops = gemm.weights.operands(weight, recipe, _state(gemm, "weight"))
                out = scaled_mm(qx, ops.quantized, x2.shape[0], weight.shape[0],
                                recipe.granularity, b)  # the bias as the GPU kernel adds it
                if need_wgrad and recipe.fp8_wgrad:
                    x_fp8 = _wgrad_fp8(x2, qx, recipe, "activation")
                elif need_wgrad:
                    x_for_wgrad = round_to_bf16(x2)  # BF16 wgrad, as the emulation's
                if need_dgrad:
                    w_fp8 = ops.dgrad_operand()
            else:
                xf = _qd(x2, gemm, "activation", -1)
                ops = gemm.weights.operands(weight, recipe, _state(gemm, "weight"))
                wf = ops.forward_copy
                out = xf @ wf.t()
                if need_wgrad:
                    x_for_wgrad = _wgrad_operand(x2, xf, recipe, "activation")
                if need_dgrad:
                    w_for_dgrad = ops.dgrad_copy()
        if b is not None and not gemm.native and not (gemm.mode == "fp8"
                                                      and gemm.backend == "torch"):
            out = out + b
        if bf16_io and not gemm.native:
            out = round_to_bf16(out)  # the GEMM's bf16 output (TE's FP8 GEMMs output bf16 too)
        ctx.save_for_backward(x_for_wgrad, w_for_dgrad, x_fp8.codes, x_fp8.scale, w_fp8.codes,
                              w_fp8.scale)
        ctx.gemm = gemm
        ctx.has_bias = bias is not None
        ctx.b_dtype = bias.dtype if bias is not None else None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_for_wgrad, w_for_dgrad, x_codes, x_scale, w_codes, w_scale = ctx.saved_tensors
        gemm: _Gemm = ctx.gemm
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).float()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_b = None
        if ctx.native is not None:
            grad_x, grad_w = native_backward(g2, gemm, ctx.native, need_dgrad, need_wgrad)
            ctx.native = None  # free the saved operands with the graph's first use
        elif gemm.mode == "fp8" and gemm.backend == "torch":
            grad_x, grad_w = _scaled_mm_grads(g2, gemm, x_for_wgrad, Fp8Operand(x_codes, x_scale),
                                              Fp8Operand(w_codes, w_scale), need_dgrad,
                                              need_wgrad)
        else:
            grad_x, grad_w = _emulated_grads(g2, gemm, x_for_wgrad, w_for_dgrad, need_dgrad,
                                             need_wgrad)
        if need_dgrad:
            if ctx.allreduce_dgrad:
                dist.all_reduce(grad_x, group=ctx.tp_group)
                if gemm.mode == "bf16":
                    grad_x = round_to_bf16(grad_x)
            grad_x = grad_x.reshape(ctx.x_shape).to(ctx.x_dtype)
        if need_wgrad:
            grad_w = grad_w.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(dim=0).to(ctx.b_dtype)  # bias grad from the unquantized dY (TE)
        return grad_x, grad_w, grad_b, None, None, None


def _emulated_grads(g2: torch.Tensor, gemm: _Gemm, x_for_wgrad: Optional[torch.Tensor],
                    w_for_dgrad: Optional[torch.Tensor], need_dgrad: bool, need_wgrad: bool):
    """(dgrad, wgrad) as fp32 GEMMs on the rounded / dequantized operands (dgrad before the
    TP all-reduce; bf16 mode rounds it to bf16, the GEMM's output)."""
    grad_x = grad_w = None
    if gemm.mode == "bf16":
        gb = round_to_bf16(g2)
        g_dgrad = g_wgrad = gb
    else:
        recipe = gemm.recipe
        g_dgrad = _qd(g2, gemm, "grad", -1)  # the one (delayed) update of the grad amax
        g_wgrad = _wgrad_operand(g2, g_dgrad, recipe, "grad") if need_wgrad else None
    if need_dgrad:
        grad_x = g_dgrad @ w_for_dgrad
        if gemm.mode == "bf16":
            grad_x = round_to_bf16(grad_x)
    if need_wgrad:
        grad_w = g_wgrad.t() @ x_for_wgrad
    return grad_x, grad_w


def _scaled_mm_grads(g2: torch.Tensor, gemm: _Gemm, x_for_wgrad: Optional[torch.Tensor],
                     x_fp8: Fp8Operand, w_fp8: Fp8Operand, need_dgrad: bool, need_wgrad: bool):
    """(dgrad, wgrad) of the torch backend: real FP8 GEMMs on the codes the emulation
    dequantizes (dY along out x W^T along out; dY^T along tokens x X^T along tokens), and
    the emulation's BF16 GEMM for the wgrad when fp8_wgrad is off."""
    recipe = gemm.recipe
    qg = _q(g2, gemm, "grad", -1)  # the one (delayed) update of the grad amax
    grad_x = grad_w = None
    if need_dgrad:
        grad_x = fp8_gemm(fp8_operand(qg, -1, recipe.granularity), w_fp8)
    if need_wgrad and recipe.fp8_wgrad:
        grad_w = fp8_gemm(_wgrad_fp8(g2, qg, recipe, "grad"), x_fp8)
    elif need_wgrad:
        grad_w = round_to_bf16(g2).t() @ x_for_wgrad
    return grad_x, grad_w


class _EmulatedLinearMixin:
    """Reads the model's PrecisionState at every forward; holds the delayed-scaling state."""

    _calibclip_emulated = True

    def _init_emulation(self, name: Optional[str]) -> None:
        # Own fp32 state until set_precision() hands every linear of the model a shared one.
        self.precision_state = PrecisionState()
        # 'qkv' | 'proj' | 'fc1' | 'fc2': megatron passes it as tp_comm_buffer_name.
        self.fp8_name = name
        self._amax_states: Optional[dict[str, AmaxHistory]] = None
        self._amax_key: Optional[tuple] = None
        self.weight_cache = WeightCache()

    def reset_fp8_state(self) -> None:
        """Drop the delayed-scaling histories (the next FP8 forward starts from scale 1)."""
        self._amax_states = None
        self._amax_key = None

    def _amax_group(self, recipe: FP8Recipe):
        if recipe.amax_reduction == "none":
            return None
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        return parallel_state.get_amax_reduction_group(
            with_context_parallel=True, tp_only_amax_red=recipe.amax_reduction == "tp"
        )

    def fp8_states(self, recipe: FP8Recipe) -> dict[str, AmaxHistory]:
        """The per-role amax histories for `recipe` (new ones if the recipe's delayed
        settings changed)."""
        key = (recipe.format, recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin,
               recipe.amax_reduction)
        if self._amax_states is None or self._amax_key != key:
            group = self._amax_group(recipe)
            self._amax_states = {
                role: AmaxHistory(recipe.element_format(role), recipe.amax_history_len,
                                  recipe.amax_compute_algo, recipe.margin, group)
                for role in ROLE_VALUES
            }
            self._amax_key = key
        return self._amax_states

    def effective_mode(self) -> str:
        """fp32 / bf16 / fp8 for this layer (fp8 only if the recipe lists the layer; the
        output layer is part of the bf16 activations, so fp32 when they are off)."""
        state = self.precision_state
        if self.fp8_name == OUTPUT_LAYER_NAME and not rounds_activations(state):
            return "fp32"
        if state.mode == "fp8" and self.fp8_name not in state.recipe.linears:
            return "bf16"
        return state.mode

    def quantized_weight(self, axis: int = -1) -> torch.Tensor:
        """The weight as the next FP8 forward's GEMM would see it (inspection only: a
        delayed-scaling history is not advanced, nothing is communicated; PendingAmaxError
        inside batched_amax_reduction() while the weight's amax waits)."""
        recipe = self.precision_state.recipe
        if recipe is None:
            raise ValueError("no FP8 recipe set on this layer (set_precision(model, 'fp8', r))")
        state = None
        if recipe.granularity == "delayed":
            history = self.fp8_states(recipe)["weight"]
            if history.waiting:
                raise PendingAmaxError("quantized_weight() inside batched_amax_reduction() while "
                                       "the weight's amax waits: inspect after the block")
            state = history.snapshot()
        weight = self.weight.detach().float()
        if recipe.weight_source == "bf16":
            weight = round_to_bf16(weight)
        return quantize_dequantize(weight, recipe, "weight", axis=axis, state=state)

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                      wgrad_deferral_limit=None, tp_group=None, **kwargs):
        mode = self.effective_mode()
        if mode == "fp32":
            return super()._forward_impl(
                input=input, weight=weight, bias=bias,
                gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                tp_group=tp_group, **kwargs,
            )
        if sequence_parallel:
            raise NotImplementedError("emulated bf16/fp8 linears do not support sequence parallel")
        if gradient_accumulation_fusion:
            raise NotImplementedError(
                "emulated bf16/fp8 linears do not support gradient_accumulation_fusion"
            )
        if grad_output_buffer is not None:
            raise NotImplementedError("emulated linears do not support deferred wgrad buffers")
        recipe = self.precision_state.recipe
        states = self.fp8_states(recipe) if (mode == "fp8" and recipe.granularity == "delayed") \
            else None
        backend = "emulated"
        if mode == "fp8":
            backend = linear_backend(recipe.backend)
            if backend == "te":
                raise ValueError("fp8.backend resolved to 'te', but this model was built with the "
                                 "emulated layer spec; build it with the Transformer Engine spec "
                                 "or set fp8.backend to 'torch' / 'emulated'")
            check_backend_supports(backend, recipe.granularity)
        path = gemm_path()
        native = path != "fp32" and backend == "emulated" and (
            mode == "bf16" or native_kernels.supports(recipe))
        # a recipe asking for fp32 activations (to attribute noise) keeps fp32 GEMM outputs
        exact = path == "exact" or (mode == "fp8" and recipe.activation_precision == "fp32")
        gemm = _Gemm(mode, recipe if mode == "fp8" else None, states, backend, self.weight_cache,
                     native, exact)
        if allreduce_dgrad and tp_group is None:
            from megatron.core.parallel_state import get_tensor_model_parallel_group

            tp_group = get_tensor_model_parallel_group()
        return _EmulatedLinearFunction.apply(input, weight, bias, gemm, allreduce_dgrad, tp_group)


class EmulatedColumnParallelLinear(_EmulatedLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear with switchable emulated BF16 / FP8 GEMMs."""

    def __init__(self, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self._init_emulation(kwargs.get("tp_comm_buffer_name"))


class EmulatedRowParallelLinear(_EmulatedLinearMixin, RowParallelLinear):
    """RowParallelLinear with switchable emulated BF16 / FP8 GEMMs."""

    def __init__(self, input_size: int, output_size: int, **kwargs) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self._init_emulation(kwargs.get("tp_comm_buffer_name"))


def fp8_linear_classes() -> dict[str, type]:
    """`local_layer_spec(cfg, **fp8_linear_classes())`: the emulated linears for the spec."""
    return {"column_linear": EmulatedColumnParallelLinear, "row_linear": EmulatedRowParallelLinear}
