"""Remove exact bf16 rounding ties from fp32 weights, reproducibly.

Why: weights dequantised from 4-bit GGUF blocks often sit exactly halfway between two bf16
values (~10% of SmolLM2's decoder weights). Round-to-nearest-even then sends all of them the
same way, and any update moves them together, which fakes BF16-vs-FP8 ratio noise (phantom
clipping). A tie is an fp32 value whose low 16 bits are exactly 0x8000; adding a random
integer d, 0 < |d| < 0x8000, to those bits shifts the value by less than half a bf16 step
(never across another bf16 value) and decides the rounding direction at random. Only ties
change; the generator is seeded per tensor name, so the result does not depend on order.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from megatron_calibclip.parallel.devices import HOST

HALF = 0x8000  # low 16 bits of an fp32 value exactly halfway between two bf16 values


def _generator(seed: int, name: str) -> torch.Generator:
    """A seeded generator on the host: the same dither on every machine."""
    digest = hashlib.sha256(f"bf16-ties:{seed}:{name}".encode()).digest()
    derived = int.from_bytes(digest[:8], "little") & (2**63 - 1)
    return torch.Generator(device=HOST).manual_seed(derived)


def bf16_tie_mask(t: torch.Tensor) -> torch.Tensor:
    """True where fp32 `t` is finite and exactly halfway between two bf16 values."""
    if t.dtype != torch.float32:
        raise TypeError(f"bf16 ties are defined for float32 tensors, got {t.dtype}")
    bits = t.contiguous().view(torch.int32)
    return ((bits & 0xFFFF) == HALF) & torch.isfinite(t)


def break_bf16_ties(
    tensors: Mapping[str, torch.Tensor],
    seed: int,
    include: Optional[Callable[[str], bool]] = None,
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """New dict where every tie in the fp32 tensors selected by `include` (default: all) is
    shifted by a random amount below half a bf16 step; also returns ties broken per tensor.
    Non-fp32 tensors are returned unchanged."""
    out: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for name, t in tensors.items():
        if t.dtype != torch.float32 or (include is not None and not include(name)):
            out[name] = t
            continue
        mask = bf16_tie_mask(t)
        n = int(mask.sum())
        counts[name] = n
        if n == 0:
            out[name] = t
            continue
        g = _generator(seed, name)
        magnitude = torch.randint(1, HALF, (n,), generator=g, dtype=torch.int32,
                                  device=HOST).to(t.device)
        sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int32,
                             device=HOST).to(t.device) * 2 - 1
        bits = t.detach().clone().contiguous().view(torch.int32)
        bits[mask] = (bits[mask] & ~0xFFFF) | (HALF + sign * magnitude)
        out[name] = bits.view(torch.float32)
    return out, counts


def copy_breaking_ties(hf_dir: os.PathLike | str, out_dir: os.PathLike | str,
                       seed: int) -> Path:
    """Copy an HF safetensors folder to a new folder with break_bf16_ties applied."""
    from megatron_calibclip.checkpoint.hf_io import (
        SafetensorsFolder,
        begin_output,
        discard_output,
        finish_output,
        hf_asset_files,
        write_safetensors_folder,
    )

    out = Path(out_dir)
    partial = begin_output(out)
    reader = SafetensorsFolder(hf_dir)
    tensors, _ = break_bf16_ties({n: reader.get(n) for n in sorted(reader.names)}, seed)
    try:
        write_safetensors_folder(partial, tensors, None, assets=hf_asset_files(Path(hf_dir)))
        return finish_output(partial, out)
    except BaseException:
        discard_output(partial)
        raise
