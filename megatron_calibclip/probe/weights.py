"""Weights as the GEMMs see them, and rounding ties: which weights an update re-rounds, which
sit exactly on a bf16 or E4M3 tie, and moving them off it (dither)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from megatron_calibclip.parallel.devices import HOST


def _gemm_weights(model, mode: str) -> list[torch.Tensor]:
    """The weights of the emulated linears as their GEMMs see them in `mode`."""
    from megatron_calibclip.fp8 import emulated_linears
    from megatron_calibclip.fp8.formats import round_to_bf16

    linears = emulated_linears(model)
    if mode == "fp32":
        return [m.weight.detach().clone() for m in linears]
    if mode == "bf16":
        return [round_to_bf16(m.weight.detach()) for m in linears]
    return [m.quantized_weight() if m.effective_mode() == "fp8" else round_to_bf16(m.weight)
            for m in linears]


def _changed_fraction(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    changed = sum(int((a != b).sum()) for a, b in zip(after, before))
    return changed / max(sum(b.numel() for b in before), 1)


def rounding_tie_fractions(model, recipes: Sequence[str]) -> dict[str, Optional[float]]:
    """Fraction of the emulated linears' weights that sit exactly on a rounding tie: halfway
    between two bf16 values ("bf16"), or, after the recipe's weight scale, halfway between two
    E4M3 values (per recipe; None for delayed, whose scale depends on history). Any update
    moves all tied weights the same way (round-half-even flips with the update's sign), which
    fakes ratio noise. With power-of-two scales (blockwise, mxfp8) every bf16-exact weight
    whose 4 low bf16 mantissa bits are 1000 is an E4M3 tie (~6% of a bf16 checkpoint)."""
    from megatron_calibclip.fp8 import E4M3, FP8Recipe, emulated_linears, quantize
    from megatron_calibclip.fp8.formats import round_to_fp8

    weights = [m.weight.detach().float() for m in emulated_linears(model)]
    total = max(sum(w.numel() for w in weights), 1)
    bf16 = sum(int(((w.contiguous().view(torch.int32) & 0xFFFF) == 0x8000).sum())
               for w in weights)
    out: dict[str, Optional[float]] = {"bf16": bf16 / total}
    for name in recipes:
        if name == "delayed":
            out[name] = None
            continue
        recipe, ties = FP8Recipe(granularity=name), 0
        for w in weights:
            q = quantize(w, recipe, "weight")
            scale = q.unblock(torch.ones_like(q.data, dtype=torch.float32) * q.scale)
            scaled = w * scale  # what the kernel rounds (fp32 product, as in quantize)
            up = round_to_fp8(torch.nextafter(scaled, torch.full_like(scaled, math.inf)), E4M3)
            dn = round_to_fp8(torch.nextafter(scaled, torch.full_like(scaled, -math.inf)), E4M3)
            ties += int(((up != dn) & (scaled.abs() < E4M3.max)).sum())
        out[name] = ties / total
    return out


def dither_weights(model, seed: int) -> int:
    """Move every tied weight of the emulated linears off its tie, keeping its bf16 value.

    fp32 bits with low 16 bits 0x8000 (bf16 ties) get 0x8000 +- d; non-zero bf16-exact values
    (low 16 bits 0, which holds every E4M3 tie under a power-of-two scale) get +- d; d in
    [1, 0x7FFF], seeded per tensor. Both stay within half a bf16 step, on the side that rounds
    to the same bf16 value (ties: a random side). Other weights are unchanged. Returns the
    number of weights moved."""
    from megatron_calibclip.fp8 import emulated_linears

    moved = 0
    with torch.no_grad():
        for i, m in enumerate(emulated_linears(model)):
            w = m.weight
            g = torch.Generator(device=HOST).manual_seed(seed * 1_000_003 + i)  # same everywhere
            bits = w.detach().float().contiguous().view(torch.int32).clone()
            low = bits & 0xFFFF
            tie = low == 0x8000
            exact = (low == 0) & (w.detach() != 0)
            d = torch.randint(1, 0x8000, bits.shape, generator=g, dtype=torch.int32, device=HOST)
            sign = torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int32, device=HOST)
            d = (d * (sign * 2 - 1)).to(bits.device)
            bits = torch.where(tie, (bits & ~0xFFFF) | (0x8000 + d), bits)
            bits = torch.where(exact, bits + d, bits)
            w.copy_(bits.view(torch.float32).to(w.dtype))
            moved += int(tie.sum() + exact.sum())
    return moved
