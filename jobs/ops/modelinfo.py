"""A model's identity, without loading it (no torch here).

``fingerprint`` is what the manifest vouches for, what a worker compares with
the job's before it runs a request, and what the result cache keys on: the
sha256 over, in a fixed order, the name and the sha256 of each file that
decides the tokens: ``config.json``, ``generation_config.json``, the tokenizer
files and every weight file (``*.safetensors`` and their index). Two
checkpoints that differ in one weight differ in fingerprint.

Hashing a weight file reads it whole (1.1 GB/s measured on one core of a loaded 2-core machine), so its
digest is remembered in ``$BATCHGEN_HOME/fingerprints``, keyed by the file's
real path and checked against its size, mtime, ctime, inode and device: a
worker start re-reads nothing unless the file changed (a rewrite in place
changes its ctime, even when its mtime is put back), and workers starting at
once hash a file once (a lock per file; the others wait and read the memo).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import redis

from batchgen.jobs.redis.embedded import home
from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.model_files import check_checkpoint

log = logging.getLogger(__name__)

# Files beside the weights that change what a model generates (those present are hashed).
IDENTITY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
)
WEIGHTS_GLOB = "*.safetensors"
_READ_CHUNK = 8 << 20


def fingerprint(model: str) -> str:
    """``sha256:<hex>`` of the checkpoint's identity files and weights; "" when
    ``model`` is not a local checkpoint directory (an HF id: the first worker sets it)."""
    root = Path(model).expanduser()
    if not (root / "config.json").is_file():
        return ""
    digest = hashlib.sha256()
    for name in IDENTITY_FILES:
        path = root / name
        if path.is_file():
            _add(digest, name, _file_sha256(path))
    for shard in sorted(root.glob(WEIGHTS_GLOB)):
        _add(digest, shard.name, weights_sha256(shard))
    return "sha256:" + digest.hexdigest()


def _add(digest: hashlib._Hash, name: str, file_digest: str) -> None:
    digest.update(f"{name}\0{file_digest}\n".encode())


def weights_sha256(path: Path) -> str:
    """The sha256 of a weight file, from the memo when the file is unchanged since."""
    real = Path(os.path.realpath(path))
    slot = memo_slot(real)
    try:
        slot.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return _file_sha256(real, announce=True)  # no writable home: hash, remember nothing
    with _locked(slot.with_suffix(".lock")):
        identity = _identity(real)
        known = _read_memo(slot.with_suffix(".json"))
        if known and known.get("identity") == identity and isinstance(known.get("sha256"), str):
            return str(known["sha256"])
        value = _file_sha256(real, announce=True)
        if _identity(real) == identity:  # unchanged while it was read: worth remembering
            _write_memo(slot.with_suffix(".json"), {"identity": identity, "sha256": value})
        return value


def memo_slot(real: Path) -> Path:
    """Where a weight file's digest is remembered (``.json``) and hashed under lock
    (``.lock``): named by its real path."""
    return home() / "fingerprints" / hashlib.sha256(str(real).encode()).hexdigest()[:32]


def _identity(path: Path) -> dict[str, object]:
    st = path.stat()
    return {
        "path": str(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }


def _file_sha256(path: Path, announce: bool = False) -> str:
    if announce:
        log.info(
            "hashing %s (%.1f GB) for the model's fingerprint", path, path.stat().st_size / 1e9
        )
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield  # cannot lock: two workers may both hash it, nothing worse
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_memo(path: Path) -> dict[str, object] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_memo(path: Path, value: dict[str, object]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not remember the digest of %s (%s)", value["identity"], exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def vocab_size(model: str) -> int | None:
    """The vocabulary size in a local checkpoint's config.json; None when it cannot tell."""
    config = Path(model).expanduser() / "config.json"
    try:
        value = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def chat_template(model: str) -> str | None:
    """A local checkpoint's chat template (tokenizer_config.json's, or chat_template.jinja
    beside it: the file wins, as in transformers); None when it has none or is not here.
    A list of named templates gives its "default" one."""
    path = Path(model).expanduser()
    try:
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    except (OSError, ValueError):
        pass
    try:
        value = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def check_submittable(conn: redis.Redis, keys: Keys, model: str, embedded: bool) -> str:
    """Refuse (ModelNotLoadable) a job for a model no worker could load; a warning to
    show, or "".

    A checkpoint directory here is checked whatever the Redis. With the embedded Redis
    every worker runs on this machine, so a model that is not here never runs: refused.
    With a shared one the checkpoint may live only on the GPU hosts: a path-like name
    that is not here, for which no live worker serves the queue, is a warning.
    """
    if embedded or Path(model).expanduser().exists():
        check_checkpoint(model)
        return ""
    if not (os.sep in model or model.startswith(("~", "."))):
        return ""  # a plain name: whatever a worker started with it serves
    if live_workers(conn, keys, keys.queue_for_model(model).tag):
        return ""
    return (
        f"{model} is not a checkpoint directory on this machine and no live worker serves "
        f"it; the job waits for `batchgen worker --model {model}` on a host that has it"
    )
