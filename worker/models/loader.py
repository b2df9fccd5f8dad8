"""Reads HF safetensors checkpoints (single file or sharded) into a ``TensorStore``."""

from __future__ import annotations

from pathlib import Path

import torch

from batchgen.jobs.schema.errors import ModelNotLoadable
from batchgen.jobs.schema.model_files import weight_files
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    try:
        return weight_files(path)
    except ModelNotLoadable as exc:
        raise UnsupportedModelError(str(exc)) from None


def read_checkpoint(path: Path, device: torch.device, dtype: torch.dtype) -> TensorStore:
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return TensorStore(tensors, path, device, dtype)
