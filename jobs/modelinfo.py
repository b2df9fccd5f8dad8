"""A model's identity for the manifest, without loading it (no torch here)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path


def fingerprint(model: str) -> str:
    """sha256 of config.json plus the weights' index (the safetensors index file, or
    each safetensors file's name, size and header); "" when not a local directory."""
    root = Path(model).expanduser()
    if not (root / "config.json").is_file():
        return ""
    digest = hashlib.sha256()
    digest.update((root / "config.json").read_bytes())
    index = root / "model.safetensors.index.json"
    if index.is_file():
        digest.update(index.read_bytes())
    for shard in sorted(root.glob("*.safetensors")):
        digest.update(shard.name.encode())
        digest.update(str(shard.stat().st_size).encode())
        with open(shard, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size < 100 << 20:
                digest.update(f.read(size))  # tensor names, dtypes, shapes, offsets
    return "sha256:" + digest.hexdigest()


def vocab_size(model: str) -> int | None:
    """The vocabulary size in a local checkpoint's config.json; None when it cannot tell."""
    config = Path(model).expanduser() / "config.json"
    try:
        value = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
