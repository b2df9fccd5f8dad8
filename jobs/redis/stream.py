"""A model's request stream and its consumer group, made on first use by either side."""

from __future__ import annotations

import redis

from batchgen.jobs.redis.keys import GROUP, QueueKeys


def ensure_group(conn: redis.Redis, qk: QueueKeys) -> None:
    """The stream and its consumer group; id 0 so entries added earlier are delivered."""
    try:
        conn.xgroup_create(qk.stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
