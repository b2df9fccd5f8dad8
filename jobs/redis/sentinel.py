"""Redis behind Sentinel: ``redis+sentinel://`` URLs, and what a write waits for.

``redis+sentinel://[user:password@]host:26379,host:26380/SERVICE[/DB]`` names the
sentinels and the service (``sentinel monitor SERVICE ...``); redis-py's Sentinel
client asks them for the current primary before every new connection, so after a
failover a reconnect (connection.py's retries and ``wait_s``) reaches the promoted
replica. ``rediss+sentinel://`` is the same over TLS, to the sentinels and the data
nodes alike, with the same rules as ``rediss://`` (certificate always verified,
``ssl_ca_certs``/``ssl_certfile``/``ssl_keyfile`` from the query or the
``BATCHGEN_REDIS_*`` variables). User and password are the data nodes'; sentinels
are reached without AUTH (protect them by network, or with TLS client certificates).

Replication is asynchronous: a write the primary acknowledged can be lost if the
primary dies before a replica has it. So through Sentinel, ``replicated`` waits
(``WAIT 1``, at most REPLICA_WAIT_MS) for one replica after the writes whose loss
would not heal by itself: submit's last chunk before it reports success, and every
commit. What can still be lost is what a failover takes within that window: a
commit whose WAIT timed out (its rows are generated again: the entries come back
from the replica's pending list, the orphan part is never listed), or chunks a
submit appended before it failed over (it re-reads ``enqueued`` from the new
primary and appends from there: nothing twice, nothing skipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

from batchgen.jobs.schema.errors import UnsafeRedisURL

SCHEMES = ("redis+sentinel", "rediss+sentinel")
REPLICA_WAIT_MS = 2000
PROBE_CHANNEL = "batchgen:replicated"  # nobody listens: the PUBLISH only moves the offset


@dataclass(slots=True, frozen=True)
class SentinelURL:
    sentinels: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None
    tls: bool


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0] in SCHEMES


def parse(url: str, where: str) -> SentinelURL:
    """The parts of a ``redis+sentinel://`` URL; ``where`` (redacted) for messages."""
    parts = urlparse(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, password = None, None
    if userinfo:
        user, has_password, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    sentinels = []
    for item in hostlist.split(","):
        host, _, port = item.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UnsafeRedisURL(
                f"Redis URL {where}: {item!r} is not host:port; give the sentinels as "
                "host:26379,host:26380"
            )
        sentinels.append((host, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise UnsafeRedisURL(
            f"Redis URL {where}: give the service and optionally the db after the sentinels "
            "(redis+sentinel://host:26379,host:26380/mymaster/0)"
        )
    db = int(path[1]) if len(path) == 2 else 0
    return SentinelURL(sentinels, unquote(path[0]), db, username, password,
                       tls=parts.scheme == "rediss+sentinel")  # fmt: skip


def client(url: str, where: str, kwargs: dict[str, Any]) -> redis.Redis:
    """A client of the service's current primary; ``kwargs`` are connection.py's
    (timeouts, retries, TLS) and go to the sentinels too, less the credentials."""
    target = parse(url, where)
    tls = {k: v for k, v in kwargs.items() if k.startswith("ssl")}
    if target.tls:
        tls["ssl"] = True
    sentinel_kwargs = {
        k: v for k, v in kwargs.items() if k.startswith(("socket_", "retry")) or k in tls
    } | tls
    sentinel = Sentinel(target.sentinels, sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(
        target.service, redis_class=redis.Redis, db=target.db, username=target.username,
        password=target.password, **kwargs, **tls,
    )  # fmt: skip


def replicated(conn: redis.Redis) -> int:
    """Through Sentinel: wait until one replica has every write the primary applied
    so far (at most REPLICA_WAIT_MS); how many replicas have them. A plain client
    returns -1 at once.

    WAIT waits for the writes of the connection it runs on, and the pool may hand
    out another than the one that wrote; so it follows a PUBLISH (propagated, never
    stored) on its own connection: a replica that acknowledges that offset holds
    every write before it, whichever connection made them.
    """
    if not isinstance(conn.connection_pool, SentinelConnectionPool):
        return -1
    pipe = conn.pipeline(transaction=False)
    pipe.publish(PROBE_CHANNEL, b"")
    pipe.wait(1, REPLICA_WAIT_MS)
    return int(pipe.execute()[-1])
