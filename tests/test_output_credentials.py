"""Object-store URIs with inline credentials are refused; secrets reach no status or output.

A URI given to ``--output`` is stored in the job's record and shown by ``status``,
``jobs --json`` and the manifest, so a credential inside it would be readable by
anyone who can read Redis or the output. Real ``batchgen submit`` commands run
against a real redis-server; credentials come from the environment (AWS_*).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from batchgen.jobs.ops.job_record import queue_of_job
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.errors import OutputError
from batchgen.jobs.storage.names import check_output
from batchgen.jobs.storage.output_store import OutputDir

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLE"  # AWS secrets hold '/' and '+'
ENV_HINT = (
    "batchgen stores the URI with the job and shows it in status, so it refuses them: give "
    "credentials by environment on every machine (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_SESSION_TOKEN for s3://; the store's own variables for the others)"
)
INLINE = [
    ("s3://AKIAEXAMPLE:" + SECRET + "@bucket/prefix", "user:secret@ before the bucket"),
    ("s3://AKIAEXAMPLE@bucket/prefix", "an access key before the bucket"),
    (
        "s3://bucket/prefix?access_key=AKIAEXAMPLE&secret_key=" + SECRET,
        "query parameter 'access_key'",
    ),
    (
        "s3://bucket/prefix?region=eu-west-1&session_token=" + SECRET,
        "query parameter 'session_token'",
    ),
    ("s3://bucket/prefix?Secret_Key=" + SECRET, "query parameter 'Secret_Key'"),
    ("gs://user:" + SECRET + "@bucket/prefix", "user:secret@ before the bucket"),
    (
        "abfss://container:" + SECRET + "@acct.dfs.core.windows.net/p",
        "user:secret@ before the bucket",
    ),
    (
        "abfs://container@acct.dfs.core.windows.net/p?sas_token=" + SECRET,
        "query parameter 'sas_token'",
    ),
    ("hdfs://etl:" + SECRET + "@namenode:8020/p", "user:secret@ before the bucket"),
]


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def batchgen(redis_url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATCHGEN_REDIS_URL": redis_url, "BATCHGEN_HOME": str(tmp_path / "h")}
    return subprocess.run([sys.executable, "-m", "batchgen", *args], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(("uri", "what"), INLINE)
def test_submit_refuses_an_output_uri_with_inline_credentials(redis_url, tmp_path, uri, what):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    out = batchgen(redis_url, tmp_path, "submit", str(prompts), "--model", "m", "--job-id", "j",
                   "--output", uri)  # fmt: skip
    scheme = uri.split("://")[0]
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        f"batchgen: error: --output: the {scheme}:// URI carries credentials ({what}); {ENV_HINT}\n"
    )
    conn = rconn(redis_url)
    assert conn.keys("*") == []  # no job was created: nothing holds the secret
    assert SECRET not in out.stderr


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bucket/prefix?region=eu-west-1&endpoint_override=localhost:9000&scheme=http",
        "abfs://container@acct.dfs.core.windows.net/p",
        "hdfs://etl@namenode:8020/p",
        "gs://anonymous@bucket/p",
        "s3://bucket/logs/user@example.com",
    ],
)
def test_uris_without_credentials_are_still_accepted(uri):
    assert check_output(uri) == uri


def test_a_stored_uri_with_credentials_is_never_opened_nor_shown(redis_url, tmp_path):
    """A job recorded before this check (planted here) still holds the secret in Redis:
    the worker side refuses to open it, and status shows it masked."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    out = batchgen(redis_url, tmp_path, "submit", str(prompts), "--model", "m", "--job-id", "j",
                   "--output", str(tmp_path / "out"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    conn = rconn(redis_url)
    planted = f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix?region=eu-west-1&secret_key={SECRET}"
    conn.hset(queue_of_job(conn, Keys("bg"), "j").job("j").job, "output", planted)
    with pytest.raises(OutputError) as info:
        OutputDir.open(planted)
    assert str(info.value) == (
        f"cannot open output: the s3:// URI carries credentials (user:secret@ before the "
        f"bucket); {ENV_HINT}"
    )
    for command in (["status", "j", "--json"], ["status", "j"], ["jobs", "--json"]):
        shown = batchgen(redis_url, tmp_path, *command)
        assert shown.returncode == 0, shown.stderr
        assert SECRET not in shown.stdout and "AKIAEXAMPLE" not in shown.stdout
    status = json.loads(batchgen(redis_url, tmp_path, "status", "j", "--json").stdout)
    assert status["output"] == "s3://***@bucket/prefix?region=eu-west-1&secret_key=***"
