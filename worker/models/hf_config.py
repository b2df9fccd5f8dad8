"""A checkpoint's config.json, read twice: as written (which switches it sets) and through
transformers (every value, defaults filled in as transformers' own model code sees them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.worker.worker_errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class HFConfig:
    path: Path  # the checkpoint directory
    raw: dict[str, Any]  # config.json as written
    hf: Any  # the transformers config object

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf, "architectures", None) or [])

    @property
    def model_type(self) -> str:
        return str(getattr(self.hf, "model_type", ""))

    @property
    def torch_dtype(self) -> str | None:
        """The dtype the checkpoint was saved in ("bfloat16", ...), when the config says."""
        dtype = getattr(self.hf, "dtype", None) or getattr(self.hf, "torch_dtype", None)
        return str(dtype).removeprefix("torch.") if dtype is not None else None


def read_hf_config(path: str | Path) -> HFConfig:
    from transformers import AutoConfig

    root = Path(path)
    file = root / "config.json"
    if not file.is_file():
        raise UnsupportedModelError(f"{root} has no config.json: not a checkpoint directory")
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot read {file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{file} is not a JSON object")
    try:
        hf = AutoConfig.from_pretrained(str(root))
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModelError(f"cannot read {file}: {exc}") from exc
    return HFConfig(root, raw, hf)
