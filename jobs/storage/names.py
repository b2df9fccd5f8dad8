"""Rules for names and output locations, so nothing writes or reads outside them.

- A job id is a plain name: letters, digits, ``.``, ``_``, ``-``; starts with a
  letter or digit; at most 128 characters; never ``..``. So ``../x``, ``/abs``,
  ``%2e%2e`` and NUL bytes are rejected wherever a job id is expected.
- ``--output`` names the job's output directory: a local path (made absolute)
  or a URI (``file://``, ``s3://``, ``gs://``, ``hdfs://``, ``abfs(s)://``). It may
  not contain NUL, ``..`` segments or percent-escapes (``%2e%2e`` is how ``..``
  hides). Without ``--output`` the job writes to ``OUTPUT_ROOT/JOB`` where
  OUTPUT_ROOT is ``$BATCHGEN_OUTPUT_ROOT`` or ``$BATCHGEN_HOME/outputs``.
- Everything a job writes lies under its output directory, under names batchgen
  makes (``parts/*.parquet``, ``result.parquet``, ``manifest.json``); a symlink
  that would take a write outside it (a symlinked ``parts`` dir, or a job dir
  under OUTPUT_ROOT pointing elsewhere) is refused (output_store.py checks real paths).
- ``download`` serves only files the manifest lists, each a plain file name.
- An output URI never carries credentials (``s3://KEY:SECRET@bucket``, an access
  key before the bucket, ``?secret_key=...``): it is stored with the job and
  shown by status, so such a URI is refused; the object store's credentials
  come from the environment (``AWS_*`` and the like) on each machine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl

from batchgen.jobs.environment import OUTPUT_ROOT
from batchgen.jobs.redis import embedded
from batchgen.jobs.schema.errors import InlineCredentials, UnsafeName, UsageError

_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")
REMOTE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "abfs", "abfss")
# Query parameters that carry a credential: access_key, secret_key, session_token,
# sas_token, account_key, client_secret, password, a SAS signature (sig), ...
_SECRET_PARAM = re.compile(r"key|secret|token|passw|credential|signature|^sig$", re.IGNORECASE)
_ENV_HINT = (
    "batchgen stores the URI with the job and shows it in status, so it refuses them: give "
    "credentials by environment on every machine (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_SESSION_TOKEN for s3://; the store's own variables for the others)"
)


def check_job_id(job_id: str) -> str:
    if not _JOB_ID.fullmatch(job_id) or ".." in job_id:
        raise UnsafeName(
            f"job id {job_id!r} is not a plain name: use letters, digits, '.', '_' and '-' "
            "(at most 128, starting with a letter or digit, no '..')"
        )
    return job_id


def check_file_name(name: str) -> str:
    """A name inside an output directory (never a path)."""
    if not _FILE_NAME.fullmatch(name) or ".." in name:
        raise UnsafeName(f"{name!r} is not a plain file name")
    return name


def output_root() -> Path:
    return OUTPUT_ROOT.get() or embedded.home() / "outputs"


def check_output(raw: str) -> str:
    """The job output directory URI for ``--output``, or UnsafeName."""
    if "\x00" in raw:
        raise UnsafeName("--output contains a NUL byte")
    if _PERCENT.search(raw):
        raise UnsafeName(
            f"--output {raw!r} contains percent-escapes; write the path plainly (no %XX)"
        )
    scheme, sep, rest = raw.partition("://")
    reason = inline_credentials(raw)
    if reason:
        raise InlineCredentials(f"--output: {reason}")
    path = rest if sep else raw
    if any(part == ".." for part in re.split(r"[/\\]", path)):
        raise UnsafeName(f"--output {raw!r} contains '..'; give the directory without it")
    if not sep:
        local = os.path.abspath(os.path.expanduser(raw))
        return local.rstrip("/") or "/"
    if scheme == "file":
        if not rest.startswith("/"):
            raise UnsafeName(f"--output {raw!r}: a file:// URI needs an absolute path")
        return rest.rstrip("/") or "/"
    if scheme not in REMOTE_SCHEMES:
        raise UnsafeName(
            f"--output {raw!r}: unsupported scheme {scheme!r}; use a local path or "
            + ", ".join(f"{s}://" for s in REMOTE_SCHEMES)
        )
    if not rest.strip("/"):
        raise UnsafeName(f"--output {raw!r} names no bucket or directory")
    return f"{scheme}://{rest.rstrip('/')}"


def _userinfo_end(head: str) -> int:
    """Where ``user:secret@`` ends in ``head`` (the URI before its query), or -1.

    A secret may hold '/' (AWS secrets do), so the userinfo is not cut at the
    first '/': it is any '@' with a ':' before it.
    """
    at = head.find("@", head.find(":") + 1) if ":" in head else -1
    return head.rfind("@") if at >= 0 else -1


def inline_credentials(uri: str) -> str | None:
    """Why ``uri`` carries credentials inline, or None."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return None
    head, _, query = rest.partition("?")
    what = ""
    if _userinfo_end(head) >= 0:
        what = "user:secret@ before the bucket"
    elif scheme == "s3" and "@" in head.split("/", 1)[0]:
        what = "an access key before the bucket"
    else:
        names = [name for name, _ in parse_qsl(query, keep_blank_values=True)]
        secret = [name for name in names if _SECRET_PARAM.search(name)]
        what = f"query parameter {secret[0]!r}" if secret else ""
    if not what:
        return None
    return f"the {scheme}:// URI carries credentials ({what}); {_ENV_HINT}"


def redact_uri(uri: str) -> str:
    """``uri`` with inline credentials masked, for a job recorded before they were refused."""
    scheme, sep, rest = uri.partition("://")
    if not sep or inline_credentials(uri) is None:
        return uri
    head, q, query = rest.partition("?")
    end = _userinfo_end(head)
    if end >= 0 or (scheme == "s3" and "@" in head.split("/", 1)[0]):
        head = "***" + head[max(end, head.find("@")) :]
    pairs = [
        f"{pair.partition('=')[0]}=***" if _SECRET_PARAM.search(pair.partition("=")[0]) else pair
        for pair in query.split("&")
    ]
    return f"{scheme}://{head}{q}{'&'.join(pairs) if q else ''}"


def default_output(job_id: str) -> str:
    """``OUTPUT_ROOT/JOB``, refusing a job dir that is a symlink out of the root."""
    root = output_root()
    job_dir = root / check_job_id(job_id)
    if job_dir.exists() or job_dir.is_symlink():
        real_root = os.path.realpath(root)
        if not os.path.realpath(job_dir).startswith(real_root + os.sep):
            raise UnsafeName(f"{job_dir} points outside the output root {root}; remove it")
    return os.path.abspath(job_dir)


def job_output_dir(given: str | None, job_id: str, embedded_redis: bool) -> str:
    """A job's output directory: ``given`` (checked), else the default, which is only
    allowed with the embedded Redis: with a shared one, workers on other hosts take the
    job's requests and must reach its output."""
    if given:
        return check_output(given)
    if not embedded_redis:
        raise UsageError(
            "the job's output directory is required with a shared Redis (submit --output, "
            "run --job-output): give one every worker can reach (a shared path, "
            "s3://bucket/prefix, ...)"
        )
    return default_output(job_id)
