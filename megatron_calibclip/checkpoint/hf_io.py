"""Reading and writing Hugging Face safetensors folders, with errors that name the file.

Why our own header check: a truncated download makes safetensors fail late (or with a
generic message); reading the 8-byte length and the JSON header first tells which file is
short and by how much, before any tensor is read. Why a partial folder: output appears
under its final name only when complete (rename), so a failed conversion leaves nothing.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_calibclip.checkpoint.errors import ConversionError

INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
              "U8": torch.uint8, "BOOL": torch.bool}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, after checking that the file is complete."""
    size = path.stat().st_size
    if size < 8:
        raise ConversionError(f"{path} is truncated or not a safetensors file ({size} bytes)")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if 8 + n > size:
            raise ConversionError(f"{path} is truncated: its header needs {8 + n} bytes, the "
                                  f"file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise ConversionError(f"{path}: unreadable safetensors header ({err})") from err
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end > size:
        raise ConversionError(f"{path} is truncated: its header describes {8 + n + end} bytes, "
                              f"the file has {size}")
    return header


class SafetensorsFolder:
    """Lazy access to the tensors of a folder (one file, or shards listed in an index)."""

    def __init__(self, folder: os.PathLike | str) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConversionError(f"{self.folder} is not a folder")
        index = self.folder / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            files = sorted({self.folder / f for f in weight_map.values()})
            for f in files:
                if not f.exists():
                    raise ConversionError(f"{index} lists {f.name}, which does not exist")
        else:
            weight_map = None
            files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{self.folder} holds no *.safetensors file")
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, meta in read_header(f).items():
                if name == "__metadata__":
                    continue
                if name in self.tensors:
                    raise ConversionError(f"tensor {name!r} is in both {self.tensors[name].file} "
                                          f"and {f}")
                dtype = _ST_DTYPES.get(meta["dtype"])
                if dtype is None:
                    raise ConversionError(f"{f}: tensor {name!r} has unsupported dtype "
                                          f"{meta['dtype']}")
                self.tensors[name] = TensorInfo(f, dtype, tuple(meta["shape"]))
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.tensors or self.tensors[name].file.name != fname:
                    raise ConversionError(f"{index} places {name!r} in {fname}, which does "
                                          f"not hold it")
        self._handles: dict[Path, Any] = {}

    @property
    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        info = self.tensors.get(name)
        if info is None:
            raise ConversionError(f"tensor {name!r} is not in {self.folder}")
        handle = self._handles.get(info.file)
        if handle is None:
            handle = self._handles[info.file] = safe_open(str(info.file), "pt")
        try:
            return handle.get_tensor(name)
        except Exception as err:  # safetensors raises its own error types
            raise ConversionError(f"{info.file}: cannot read tensor {name!r}: {err}") from err


# ---------------------------------------------------------------------- output folders
def begin_output(out: Path) -> Path:
    """Refuse an existing `out`; return the sibling folder to write into (see finish_output)."""
    out = Path(out)
    if out.exists():
        raise ConversionError(f"output folder {out} already exists; choose a new path or "
                              f"remove it")
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    return partial


def finish_output(partial: Path, out: Path) -> Path:
    if out.exists():
        raise ConversionError(f"output folder {out} appeared while converting; left {partial}")
    os.replace(partial, out)
    return out


def discard_output(partial: Path) -> None:
    shutil.rmtree(partial, ignore_errors=True)


def hf_asset_files(folder: Path) -> list[Path]:
    """Non-weight files of an HF folder (config, tokenizer, generation config, template)."""
    return sorted(p for p in Path(folder).iterdir()
                  if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES)
                  and p.name != INDEX_FILE and not p.name.startswith("."))


def write_safetensors_folder(
    folder: Path,
    tensors: Mapping[str, torch.Tensor],
    config: Optional[Mapping[str, Any]] = None,
    *,
    assets: Iterable[Path] = (),
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write tensors (sharded past max_shard_bytes, with an index) + config.json + assets."""
    folder.mkdir(parents=True, exist_ok=True)
    for src in assets:
        shutil.copy2(src, folder / src.name)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                            encoding="utf-8")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.clone() if t.untyped_storage().nbytes() != nbytes else t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n",
        encoding="utf-8")
