"""What ``batchgen serve`` runs with: keys, where files and outputs go, its limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.jobs.environment import API_KEYS
from batchgen.serve.api_keys import KeyRing

MAX_FILE_BYTES = 200 << 20  # an upload over this is refused with 413
LOOPBACK = ("127.0.0.1", "::1", "localhost")
DAY_S = 86400


@dataclass(slots=True)
class ServeConfig:
    files_dir: str  # uploaded and result files (local path or object-store URI)
    output_root: str  # each batch's job writes its Parquet under OUTPUT_ROOT/BATCH_ID
    redis_url: str
    keyring: KeyRing = field(default_factory=KeyRing)  # no keys: no auth, loopback only
    max_file_bytes: int = MAX_FILE_BYTES
    tick_s: float = 1.0  # how often open batches are looked at (expiry, output files)
    sample_s: float = 5.0  # tok/s sampling interval for the dashboard's chart
    refresh_ms: int = 2000  # the dashboard's refresh interval
    lease_s: float = 10.0  # a batch's validation or output writing: held, renewed, this long
    model_wait_s: float = 600.0  # how long a batch waits for a worker starting for its model
    file_expiry_s: int = 30 * DAY_S  # uploads, unless expires_after says (0: never)
    output_expiry_s: int = 30 * DAY_S  # output files and the batch record (0: never)
    session_s: int = DAY_S  # a dashboard sign-in lasts this long (or until sign-out)


def expiry(raw: str, flag: str) -> int:
    """``30d``, ``12h``, ``3600`` (seconds) or ``never`` (0) for an expiry flag."""
    if raw.strip().lower() == "never":
        return 0
    from batchgen.jobs.ops.retention import parse

    return parse(raw, flag)


def keys_from_env(given: tuple[str, ...]) -> list[str]:
    """``--api-key`` values, else ``BATCHGEN_API_KEYS`` (comma-separated)."""
    raw = list(given) or API_KEYS.get()
    return [k.strip() for k in raw if k.strip()]
