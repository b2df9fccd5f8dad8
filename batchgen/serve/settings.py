"""What ``batchgen serve`` runs with: keys, where files and outputs go, its limits."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

MAX_FILE_BYTES = 200 << 20  # an upload over this is refused with 413
LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(slots=True)
class ServeConfig:
    files_dir: str  # uploaded and result files (local path or object-store URI)
    output_root: str  # each batch's job writes its Parquet under OUTPUT_ROOT/BATCH_ID
    redis_url: str
    api_keys: list[str] = field(default_factory=list)  # empty: no auth, loopback only
    max_file_bytes: int = MAX_FILE_BYTES
    tick_s: float = 1.0  # how often open batches are looked at (expiry, output files)
    sample_s: float = 5.0  # tok/s sampling interval for the dashboard's chart
    refresh_ms: int = 2000  # the dashboard's refresh interval


def keys_from_env(given: tuple[str, ...]) -> list[str]:
    """``--api-key`` values, else ``BATCHGEN_API_KEYS`` (comma-separated)."""
    raw = list(given) or os.environ.get("BATCHGEN_API_KEYS", "").split(",")
    return [k.strip() for k in raw if k.strip()]
