"""A submit interrupted after it claimed the job's output directory and before the job
reached Redis (Redis refusing writes there, or the process killed) is finished by
re-running it with the same ``--job-id``: one job, every line once, the tenant's quota
holding exactly that job's share. A real `batchgen submit` process frozen at the point
(crashpoints.py) while a real redis-server starts refusing (tests/chaos/refusals.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from batchgen.jobs.ops.fair_share import backlog, tenants
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer
from tests.chaos.harness import wait_until
from tests.chaos.refusals import Refusal

KEYS = Keys("bg")
QK = KEYS.queue_for_model("m")


def submit(url: str, src: Path, out: Path, **env: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "batchgen", "submit", str(src), "--model", "m",
               "--output", str(out), "--job-id", "J", "--redis", url, "--json"]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env})  # fmt: skip


@pytest.mark.parametrize("fault", ["OOM", "READONLY", "killed"])
def test_a_submit_interrupted_after_its_output_claim_is_finished_by_its_retry(
    private_redis: RedisServer, tmp_path: Path, fault: str
):
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p {i}"}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    url = private_redis.url
    if fault == "killed":
        first = submit(url, src, out, BATCHGEN_TEST_CRASH_AT="after_output_claim")
        _, err = first.communicate(timeout=120)
        assert first.returncode == 77, err
    else:
        first = submit(url, src, out, BATCHGEN_TEST_CRASH_AT="after_output_claim:1:stop")
        frozen = psutil.Process(first.pid)
        wait_until(lambda: frozen.status() == psutil.STATUS_STOPPED, 120, "the claim")
        refusal = Refusal(fault, private_redis, tmp_path)
        refusal.refuse()
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=120)
        refusal.allow()
        assert first.returncode == 1, err
        assert f"batchgen: error: Redis at the configured server cannot serve now ({fault} " in err
    conn: Any = redis.Redis.from_url(url)
    assert not conn.exists(QK.job("J").job)  # interrupted before the job was created
    assert (out / "batchgen-job.json").exists()  # after its output was claimed

    retry = submit(url, src, out)
    stdout, err = retry.communicate(timeout=120)
    assert retry.returncode == 0, err
    assert json.loads(stdout)["total"] == 5
    assert {k.decode() for k in conn.hkeys(KEYS.jobs)} == {"J"}
    assert [json.loads(r)["p"] for _, _, r in backlog.queued(conn, QK, "J")] == [
        f"p {i}" for i in range(5)
    ]
    job = {k.decode(): v.decode() for k, v in conn.hgetall(QK.job("J").job).items()}
    est, tenant = int(job["est_input_tokens"]), job["tenant"]  # the login name's tenant
    assert est > 0 and tenants.holding(conn, KEYS, tenant) == {"jobs": 1, "enqueued_tokens": est}
    assert {k.decode() for k in conn.hkeys(KEYS.tenant(tenant).jobs)} == {"J"}
