"""Reads HF safetensors checkpoints (single file or sharded) into a ``TensorStore``."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from batchgen.jobs.schema.errors import ModelNotLoadable
from batchgen.jobs.schema.model_files import weight_files
from batchgen.worker.models.tensor_store import Lazy, TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    try:
        return weight_files(path)
    except ModelNotLoadable as exc:
        raise UnsupportedModelError(str(exc)) from None


def read_checkpoint(path: Path, device: torch.device, dtype: torch.dtype) -> TensorStore:
    """The checkpoint's tensors by name, each read from its file when the store hands it
    out: one read of its bytes into a new tensor (no mapping of the file, whose pages
    would stay in the process's memory while mapped); each file's header is read once."""
    tensors: dict[str, torch.Tensor | Lazy] = {}
    for file in checkpoint_files(path):
        for name, entry in _header(file).items():
            tensors[name] = functools.partial(_read, file, name, entry)
    return TensorStore(tensors, path, device, dtype)


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one tensor's bytes lie in its safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # from the file's start
    stop: int


def _header(file: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file holds: an 8-byte little-endian header length, then
    the JSON header (name -> dtype, shape, data_offsets from the end of the header)."""
    from safetensors.torch import _TYPES  # the format's dtype names, as safetensors maps them

    try:
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        base = 8 + size
        entries = {}
        for name, e in header.items():
            dtype = _TYPES[e["dtype"]]
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"tensor {name!r}: dtype {e['dtype']} (not in this torch)")
            start, stop = (base + o for o in e["data_offsets"])
            entries[name] = _Entry(dtype, tuple(e["shape"]), start, stop)
        return entries
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise UnsupportedModelError(
            f"{file} is not a safetensors file batchgen reads ({exc!r})"
        ) from None


def _read(file: Path, name: str, entry: _Entry) -> torch.Tensor:
    tensor = torch.empty(entry.shape, dtype=entry.dtype)
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    with file.open("rb") as f:
        f.seek(entry.start)
        got = f.readinto(cast(Any, data))
    if got != entry.stop - entry.start or got != data.nbytes:
        raise UnsupportedModelError(
            f"{file}: tensor {name!r} of {entry.stop - entry.start} bytes for {entry.shape} "
            f"{entry.dtype} ends after {got} (a truncated or damaged checkpoint)"
        )
    return tensor
