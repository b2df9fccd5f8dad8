"""Reads HF safetensors checkpoints (single file or sharded) into a ``TensorStore``."""

from __future__ import annotations

import functools
from pathlib import Path

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
    out (the file mapped for that read only, so its pages leave with the read)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor | Lazy] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = functools.partial(_read, file, name)
    return TensorStore(tensors, path, device, dtype)


def _read(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)
