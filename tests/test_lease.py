"""A lease whose Redis stalls for longer than its TTL (a real redis-server frozen with
SIGSTOP): serve's instance lease (``retake``) is taken back once Redis serves again; a
lease on work (a batch's, a finalize's) stays lost, since another process may hold it."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import pytest
import redis

from batchgen.jobs.redis.lease import Lease
from batchgen.jobs.redis.redis_server import RedisServer
from tests.chaos.harness import wait_until


@pytest.mark.parametrize("retake", [True, False])
def test_a_lease_expired_in_an_outage_is_taken_back_only_when_it_says_so(
    private_redis: RedisServer, retake: bool, caplog: pytest.LogCaptureFixture
):
    conn: Any = redis.Redis.from_url(private_redis.url)
    assert private_redis.process is not None
    pid = private_redis.process.pid
    caplog.set_level(logging.WARNING, logger="batchgen.jobs.redis.lease")
    with Lease(conn, "bg:serve:instance:x", 0.3, "serve-x", retake=retake) as lease:
        os.kill(pid, signal.SIGSTOP)  # no reply for 3 TTLs: the key expires meanwhile
        try:
            time.sleep(1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        if retake:
            wait_until(lambda: "taken back" in caplog.text, 10, "the lease to be taken back")
            time.sleep(0.5)  # renewed since
            assert conn.get("bg:serve:instance:x") == lease.token.encode() and not lease.lost
            assert [r.getMessage() for r in caplog.records] == [
                "lease bg:serve:instance:x had expired (Redis out of reach past its TTL); "
                "taken back"
            ]
        else:
            wait_until(lambda: lease.lost, 10, "the lease to be found lost")
            assert conn.get("bg:serve:instance:x") is None
    assert conn.get("bg:serve:instance:x") is None  # released on exit
