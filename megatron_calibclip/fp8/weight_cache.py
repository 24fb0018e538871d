"""The weight operands of an emulated linear, kept until its master weight changes.

Why: a rollout decodes one token at a time, and re-quantizing every weight at every forward
made weight quantization the largest cost of a SmolLM2 step on CPU. Transformer Engine
caches FP8 weights between micro-batches the same way (`is_first_microbatch`), and a
rollout engine holds quantized weights between weight syncs: the values a GEMM reads are
the same, only computed once.

An entry is valid while all of these hold: the same weight storage (`data_ptr`) at the same
version counter (in-place writes, the optimizer's and `load_state_dict`'s `copy_`, bump
it), the same weight epoch (`invalidate_weight_caches` bumps it, for writes that go
through `.data`, which bypass the version counter), the same mode, recipe and backend, and
under delayed scaling the same scale (the amax history moves the scale; a hit re-records
the cached amax so the history advances exactly as a re-quantization would).

Policy, process-wide (`CALIBCLIP_WEIGHT_CACHE` or `set_weight_cache_policy`): "on"
(default), "off" (re-quantize at every forward, the reference), "verify" (use the cache and
recompute beside it at every forward, the dgrad copies too once an entry holds them (the
emulation's values, the torch backend's codes and scales); a difference raises
StaleWeightCacheError: what tests run to prove no write path was missed).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_calibclip.fp8.delayed import AmaxHistory
from megatron_calibclip.fp8.formats import round_to_bf16
from megatron_calibclip.fp8.native import GemmOperand, native_operand
from megatron_calibclip.fp8.quantize import Quantized, quantize, same_both_ways
from megatron_calibclip.fp8.recipe import FP8Recipe
from megatron_calibclip.fp8.scaled_mm import Fp8Operand, fp8_operand

POLICIES = ("on", "off", "verify")
_ENV = "CALIBCLIP_WEIGHT_CACHE"
_policy: Optional[str] = None


class StaleWeightCacheError(RuntimeError):
    """The cached weight operands differ from a fresh quantization (verify policy): some
    code changed a weight without bumping its version or calling invalidate_weight_caches."""


def weight_cache_policy() -> str:
    """The policy in force: set_weight_cache_policy's, else $CALIBCLIP_WEIGHT_CACHE, else on."""
    if _policy is not None:
        return _policy
    value = os.environ.get(_ENV, "on").strip().lower() or "on"
    if value not in POLICIES:
        raise ValueError(f"{_ENV}={value!r} is not one of {list(POLICIES)}")
    return value


def set_weight_cache_policy(policy: Optional[str]) -> None:
    """Override the policy for this process (None: back to the environment's)."""
    global _policy
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"weight cache policy {policy!r} is not one of {list(POLICIES)}")
    _policy = policy


_epoch = 0


def invalidate_weight_caches(model: Optional[torch.nn.Module] = None) -> None:
    """Drop the cached weight operands of `model`'s linears (of every model if None), after
    writing weights through `.data` (megatron's distributed optimizer copies its updated
    main params into the model that way)."""
    global _epoch
    if model is None:
        _epoch += 1
        return
    for m in model.modules():
        cache = getattr(m, "weight_cache", None)
        if isinstance(cache, WeightCache):
            cache.clear()


def _source(weight: torch.Tensor, recipe: Optional[FP8Recipe]) -> torch.Tensor:
    """What the weight quantizer (or the BF16 GEMM) reads: the bf16 copy or the fp32 master."""
    w = weight.detach().float()
    return round_to_bf16(w) if recipe is None or recipe.weight_source == "bf16" else w


def _bf16_copy(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 model copy a BF16 GEMM reads (2 bytes per weight, as on a GPU)."""
    return weight.detach().to(torch.bfloat16)


@dataclass
class WeightOperands:
    """The weight as one forward's GEMMs read it (bf16: the bf16 copy; fp8: the codes)."""

    weight: torch.Tensor  # the master (to rebuild the transposed copy lazily)
    recipe: Optional[FP8Recipe]  # None in bf16 mode
    # fp32 values the fp32 emulation (gemm path "fp32") multiplies with, built on first use:
    # bf16 mode the bf16 copy, fp8 the dequantized codes; the native kernels and the torch
    # backend never build it (a GPU run keeps the 1-byte codes here, not 4 more bytes)
    _forward: Optional[torch.Tensor]
    quantized: Optional[Quantized] = None  # fp8: codes + scales (the torch backend's input)
    bf16_copy: Optional[torch.Tensor] = None  # bf16 mode: the bf16 weight (bf16 dtype)
    amax: Optional[torch.Tensor] = None  # delayed: re-recorded at every hit
    scale: Optional[torch.Tensor] = None  # delayed: the scale these codes were made with
    _dgrad: Optional[torch.Tensor] = field(default=None, repr=False)
    _dgrad_q: Optional[Quantized] = field(default=None, repr=False)
    _dgrad_fp8: Optional[Fp8Operand] = field(default=None, repr=False)
    _native: Optional[GemmOperand] = field(default=None, repr=False)
    _native_dgrad: Optional[GemmOperand] = field(default=None, repr=False)

    @property
    def forward_copy(self) -> torch.Tensor:
        """fp32 values the fp32-emulated forward GEMM multiplies with (built on first use)."""
        if self._forward is None:
            self._forward = self.bf16_copy.float() if self.recipe is None \
                else self.quantized.dequantize(torch.float32)
        return self._forward

    def native_forward(self) -> GemmOperand:
        """The FP8 weight as the native forward GEMM reads it ([out, in], K = in)."""
        if self._native is None:
            self._native = native_operand(self.quantized, -1, self.recipe)
        return self._native

    def native_dgrad(self) -> GemmOperand:
        """The FP8 weight as the native dgrad GEMM reads it: W^T [in, out] (K = out),
        quantized along the output dim."""
        if self._native_dgrad is None:
            self._native_dgrad = native_operand(self._dgrad_quantized(), 0, self.recipe)
        return self._native_dgrad

    def _dgrad_quantized(self) -> Quantized:
        """The weight quantized along the output dim (the dgrad GEMM's reduction dim): the
        forward's codes when the scaling is the same both ways."""
        if self._dgrad_q is None:
            if same_both_ways(self.recipe, "weight"):
                self._dgrad_q = self.quantized
            else:
                w = _source(self.weight, self.recipe)
                self._dgrad_q = quantize(w, self.recipe, "weight", axis=0)
        return self._dgrad_q

    def dgrad_copy(self) -> torch.Tensor:
        """The weight as the emulated dgrad GEMM reads it (quantized along the output dim)."""
        if self._dgrad is None:
            if self.recipe is None or same_both_ways(self.recipe, "weight"):
                self._dgrad = self.forward_copy
            else:
                self._dgrad = self._dgrad_quantized().dequantize(torch.float32)
        return self._dgrad

    def dgrad_operand(self) -> Fp8Operand:
        """The same copy as the torch backend's dgrad GEMM reads it: the codes of W^T
        [in, out] (reducing along out) and their scales, one per input feature if rowwise."""
        if self._dgrad_fp8 is None:
            self._dgrad_fp8 = fp8_operand(self._dgrad_quantized(), 0, self.recipe.granularity)
        return self._dgrad_fp8


def _build(weight: torch.Tensor, recipe: Optional[FP8Recipe],
           state: Optional[AmaxHistory]) -> WeightOperands:
    if recipe is None:  # bf16 GEMM
        return WeightOperands(weight, None, None, bf16_copy=_bf16_copy(weight))
    w = _source(weight, recipe)
    scale = amax = None
    if state is not None:
        scale, amax = state.quantize_scale().clone(), w.abs().amax()
    q = quantize(w, recipe, "weight", axis=-1, state=state)
    return WeightOperands(weight, recipe, None, q, amax=amax, scale=scale)


def _same_codes(a: Quantized, b: Quantized) -> bool:
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) \
        and torch.equal(a.scale_inv, b.scale_inv)


def _same_scale(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _same(fresh: WeightOperands, cached: WeightOperands) -> bool:
    """Whether the cached operands equal a fresh build; the lazily built dgrad copies are
    compared when the cache holds them (a stale one would feed the next backward)."""
    if (fresh.quantized is None) != (cached.quantized is None):
        return False
    if fresh.quantized is None:  # bf16: the copy itself
        return torch.equal(fresh.bf16_copy, cached.bf16_copy)
    if not _same_codes(fresh.quantized, cached.quantized):
        return False
    for lazy in ("_native", "_native_dgrad"):
        old = getattr(cached, lazy)
        if old is not None:
            new = fresh.native_forward() if lazy == "_native" else fresh.native_dgrad()
            if not (torch.equal(new.values, old.values) and _same_scale(new.scale, old.scale)):
                return False
    if cached._forward is not None and not torch.equal(fresh.forward_copy, cached._forward):
        return False
    if cached._dgrad is not None and not torch.equal(fresh.dgrad_copy(), cached._dgrad):
        return False
    if cached._dgrad_fp8 is not None:
        new, old = fresh.dgrad_operand(), cached._dgrad_fp8
        if not (torch.equal(new.codes.view(torch.uint8), old.codes.view(torch.uint8))
                and torch.equal(new.scale, old.scale)):
            return False
    return True


def _same_delayed_scale(state: AmaxHistory, entry: WeightOperands) -> bool:
    """Whether delayed scaling's current scale is the one the cached codes were made with.
    Only asked on the CPU, where comparing values costs nothing; on an accelerator the answer
    would wait for the device (a host synchronisation per linear per forward), so there a
    delayed-scaling weight is re-quantized instead: the same operands, and cheap next to
    its GEMM."""
    scale = state.quantize_scale()
    if entry.scale.device.type != "cpu" or scale.device.type != "cpu":
        return False
    return torch.equal(scale, entry.scale)


class WeightCache:
    """One linear's cache: a single entry, replaced when its key no longer matches."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._entry: Optional[WeightOperands] = None
        self.builds = 0  # how many times the operands were computed (tests, benchmarks)

    def clear(self) -> None:
        self._key, self._entry = None, None

    def operands(self, weight: torch.Tensor, recipe: Optional[FP8Recipe],
                 state: Optional[AmaxHistory] = None) -> WeightOperands:
        """This forward's weight operands; `recipe` None means a BF16 GEMM. Under delayed
        scaling `state` advances exactly once, as one quantization would advance it."""
        policy = weight_cache_policy()
        if policy == "off":
            self.clear()
            self.builds += 1
            return _build(weight, recipe, state)
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype,
               weight.device, _epoch, recipe)
        entry = self._entry
        hit = entry is not None and self._key == key and (
            state is None or _same_delayed_scale(state, entry))
        if not hit:
            self.builds += 1
            self._key, self._entry = key, _build(weight, recipe, state)
            return self._entry
        if policy == "verify":
            fresh = _build(weight, recipe, state.snapshot() if state is not None else None)
            if not _same(fresh, entry):
                raise StaleWeightCacheError(
                    f"cached weight operands of a {tuple(weight.shape)} weight differ from a "
                    "fresh quantization: the weight was changed without bumping its version "
                    "counter; call fp8.weight_cache.invalidate_weight_caches() after such writes")
        if state is not None:
            state.record(entry.amax)  # the history advances as a re-quantization's would
        return entry
