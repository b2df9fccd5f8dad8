"""Reads HF safetensors checkpoints (single file or sharded) into a ``TensorStore``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from batchgen.worker.models.model_config import UnsupportedModelError
from batchgen.worker.models.tensor_store import TensorStore


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UnsupportedModelError(
                f"{path} is missing shard(s) named in its index: {', '.join(missing)}"
            )
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise UnsupportedModelError(
            f"{path} holds PyTorch .bin weights; batchgen reads only safetensors "
            "(convert with transformers: model.save_pretrained(dir))"
        )
    raise UnsupportedModelError(f"{path} has no model.safetensors or model.safetensors.index.json")


def read_checkpoint(path: Path, device: torch.device, dtype: torch.dtype) -> TensorStore:
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return TensorStore(tensors, path, device, dtype)
