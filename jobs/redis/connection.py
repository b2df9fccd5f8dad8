"""Connecting to Redis: which server, TLS, timeouts, retries, and a safety check.

The URL comes from ``--redis``, else ``BATCHGEN_REDIS_URL``, else the embedded
server (embedded.py). ``rediss://`` verifies the server certificate
(``ssl_cert_reqs=required`` always); a CA bundle and a client certificate come
from the URL query (``?ssl_ca_certs=...&ssl_certfile=...&ssl_keyfile=...``) or
``BATCHGEN_REDIS_CA`` / ``BATCHGEN_REDIS_CERT`` / ``BATCHGEN_REDIS_KEY``.
User and password go in the URL (``rediss://user:pass@host:6380/0``).
``redis+sentinel://host:26379,host:26380/mymaster/0`` (``rediss+sentinel://``
with TLS) reaches the primary through Sentinel, with the same rules
(sentinel.py).
No other query parameter is accepted (check_url): redis-py hands query
parameters to the connection and lets them override ours, so
``?ssl_cert_reqs=none`` or ``?ssl_check_hostname=false`` would turn verification
off. Only ``ssl_cert_reqs=required`` and ``ssl_check_hostname=true`` (what
batchgen sets anyway) and ``db`` may also appear.

redis-py 8 defaults to a 5 s socket timeout, shorter than a long XREADGROUP
BLOCK; callers that block pass ``block_s`` and get a socket timeout above it.

A command started while Redis restarts waits for it: ``wait_s`` (the CLI's is
``BATCHGEN_REDIS_WAIT``, default 10 s) of reconnecting with backoff before the
one-line "cannot reach Redis" error. A refused password or certificate is not
waited for.

An error reply that says the server cannot serve now, not that the command is
wrong (BUSY: a script past ``lua-time-limit``; OOM: ``maxmemory`` under
noeviction; MISCONF: a failed snapshot stops writes; READONLY: a replica, say a
demoted primary; LOADING: the dataset is still being read), is an outage like a
dropped connection: the parser every client of ``connect`` uses raises it as
``RedisRefused``, a ``redis.ConnectionError``, so redis-py retries it with
backoff and every caller that waits out an outage waits this out too, in one
place. Such a reply inside a script's error (Redis 6 wraps a refused
``redis.call`` as ``ERR Error running script ...: -OOM ...``) counts the same;
every other reply (WRONGTYPE, a script's own error) stays a ``ResponseError``.
NOSCRIPT is not among them: redis-py's Script loads the script and runs it again
(lua.py).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlparse

import redis
from redis._parsers import _RESP3Parser
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from batchgen.jobs.backoff import backoff_delay
from batchgen.jobs.environment import REDIS_CA, REDIS_CERT, REDIS_KEY, REDIS_URL
from batchgen.jobs.redis import cmdline, embedded, sentinel
from batchgen.jobs.redis.redis_errors import RedisRefused
from batchgen.jobs.schema.errors import (
    QueueFull,
    RedisUnavailable,
    UnsafeRedis,
    UnsafeRedisURL,
)

_TLS_ENV = {"ssl_ca_certs": REDIS_CA, "ssl_certfile": REDIS_CERT, "ssl_keyfile": REDIS_KEY}
# scheme://user:PASSWORD@host: redis-py's password ends at the host's last '@'
_PASSWORD = re.compile(r"^([a-z+]+://[^:@/?#]*:)([^/?#]*)@")
_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")
_TLS_SCHEMES = ("rediss", "rediss+sentinel")
_PLAIN_PARAMS = ("db", *_TLS_ENV)
# The verification switches, each with the one value that keeps verification on.
_VERIFY_PARAMS = {"ssl_cert_reqs": "required", "ssl_check_hostname": "true"}


# Replies by which a server says it cannot serve now; the command did not run.
OUTAGE_REPLIES = ("BUSY", "OOM", "MISCONF", "READONLY", "LOADING")
_SCRIPT_REFUSAL = re.compile(r"^Error running script .*?: -(" + "|".join(OUTAGE_REPLIES) + ") ")


def refusal_code(exc: BaseException) -> str | None:
    """The OUTAGE_REPLIES code of a reply redis-py parsed, or None for any other."""
    if isinstance(exc, RedisRefused):
        return exc.code
    if isinstance(exc, redis.BusyLoadingError):
        return "LOADING"
    if not isinstance(exc, redis.ResponseError):
        return None
    code = getattr(exc, "status_code", None)
    if code in OUTAGE_REPLIES:
        return code
    match = _SCRIPT_REFUSAL.match(str(exc)) if code == "ERR" else None
    return match.group(1) if match else None


class OutageParser(_RESP3Parser):
    """redis-py's parser for RESP3 (its default protocol), raising the replies of OUTAGE_REPLIES as RedisRefused."""

    @classmethod
    def parse_error(cls, response: str) -> redis.RedisError:
        exc = super().parse_error(response)
        code = refusal_code(exc)
        if code is None:
            return exc
        return RedisRefused(code, str(exc).removeprefix(f"{code} "))


@dataclass(slots=True, frozen=True)
class Target:
    url: str
    embedded: bool  # the machine-local default server


def resolve(url: str | None = None) -> Target:
    """Which Redis to use; starts the embedded server when nothing is configured."""
    chosen = url or REDIS_URL.get()
    if chosen:
        if not chosen.startswith(_SCHEMES):
            raise RedisUnavailable(
                f"unsupported Redis URL {redact(chosen)!r}: use redis://, rediss://, unix:// "
                "or redis+sentinel:// (rediss+sentinel://)"
            )
        check_url(chosen)
        return Target(chosen, embedded=False)
    return Target(embedded.ensure_running(), embedded=True)


def check_url(url: str) -> None:
    """Refuse query parameters that could weaken TLS verification, or that we do not know.

    The query is read exactly as redis-py reads it (``urlparse`` + ``parse_qs``:
    percent-escapes and ``+`` decoded), so no spelling slips past: the names are
    compared case-blind for the message, exactly for acceptance, and a name given
    twice is refused (redis-py would keep the first).
    """
    parts = urlparse(url)
    where = redact(url.split("?", 1)[0])
    seen: set[str] = set()
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        lower = name.lower()
        if name == "db" and sentinel.is_sentinel(url):
            raise UnsafeRedisURL(
                f"Redis URL {where}: give the db after the service (.../mymaster/0), not as ?db="
            )
        if name in _PLAIN_PARAMS:
            if name != "db" and parts.scheme not in _TLS_SCHEMES:
                raise UnsafeRedisURL(
                    f"Redis URL {where}: TLS parameters need a rediss:// URL ({name})"
                )
        elif lower.startswith("ssl_"):
            keeps_verifying = _VERIFY_PARAMS.get(name) == value.lower()
            if not keeps_verifying or parts.scheme not in _TLS_SCHEMES:
                raise UnsafeRedisURL(
                    f"Redis URL {where}: {_shown(name, value)} could weaken TLS verification; "
                    "batchgen always verifies the server's certificate and host name: remove it "
                    "(give the CA with ssl_ca_certs=PATH or BATCHGEN_REDIS_CA)"
                )
        else:
            raise UnsafeRedisURL(
                f"Redis URL {where}: unsupported parameter {name!r}; batchgen accepts only "
                f"{', '.join(_PLAIN_PARAMS)} (user and password go before the host: "
                "redis://user:password@host:port/db)"
            )
        if name in seen:
            raise UnsafeRedisURL(f"Redis URL {where}: {name!r} is given twice; give it once")
        seen.add(name)
    if sentinel.is_sentinel(url):
        sentinel.parse(url, where)


def _shown(name: str, value: str) -> str:
    """A refused TLS parameter for the message: the switches with their value (never a
    secret), any other (say ``ssl_password``) by name only."""
    if name.lower() not in _VERIFY_PARAMS:
        return name
    return f"{name}={value}" if re.fullmatch(r"[\w.-]+", value) else f"{name}={value!r}"


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    return _PASSWORD.sub(r"\1***@", url)


def hide_password_from_ps(url: str) -> None:
    """``url`` came on our command line (``--redis``): overwrite its password there."""
    match = _PASSWORD.match(url)
    if match:
        cmdline.hide(match.group(2))


def connect(
    url: str | None = None,
    *,
    block_s: float = 0.0,
    retries: int = 3,
    check_policy: bool = True,
    wait_s: float = 0.0,
) -> redis.Redis:
    """A client for the chosen server, checked to be reachable and non-evicting.

    ``retries`` reconnect attempts with jittered exponential backoff (capped at
    2 s) are made per command before a ConnectionError surfaces. An unreachable
    server is waited for up to ``wait_s`` more (a restart), with backoff.
    """
    target = resolve(url)
    kwargs: dict = {
        "socket_timeout": max(10.0, block_s + 10.0),
        "socket_connect_timeout": 5.0,
        "health_check_interval": 30,
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "parser_class": OutageParser,
    }
    if not target.url.startswith("unix://"):
        kwargs["socket_keepalive"] = True
    if target.url.startswith(("rediss://", "rediss+sentinel://")):
        kwargs["ssl_cert_reqs"] = "required"  # never "none": fail closed on a bad cert
        for arg, variable in _TLS_ENV.items():
            value = variable.get()
            if value and f"{arg}=" not in target.url:
                kwargs[arg] = value
    if sentinel.is_sentinel(target.url):
        query = urlparse(target.url).query
        kwargs |= {k: v for k, v in parse_qsl(query) if k in _TLS_ENV}  # check_url's
        client = sentinel.client(target.url, redact(target.url), kwargs)
    else:
        client = redis.Redis.from_url(target.url, **kwargs)
    deadline = time.monotonic() + wait_s
    attempt = 0
    while check_policy:
        try:
            check_server(client, target.url)
            break
        except RedisUnavailable as exc:
            delay = backoff_delay(attempt, 0.1, 1.0)
            if not exc.transient or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        attempt += 1
    return client


def check_server(client: redis.Redis, url: str = "") -> None:
    """Reachable, authenticated, and ``maxmemory-policy`` cannot evict our keys."""
    where = redact(url) if url else "Redis"
    try:
        info = client.info("memory")
    except redis.AuthenticationError as exc:
        raise RedisUnavailable(f"Redis at {where} refused the credentials: {exc}") from exc
    except redis.ConnectionError as exc:
        message = describe_connection_error(exc, url)
        raise RedisUnavailable(message, transient=not message.startswith("TLS")) from exc
    except redis.TimeoutError as exc:
        raise RedisUnavailable(
            f"Redis at {where} did not answer in time: {exc}", transient=True
        ) from exc
    policy = str(info.get("maxmemory_policy", "noeviction"))
    if policy != "noeviction":
        raise UnsafeRedis(
            f"Redis at {where} has maxmemory-policy {policy}, which can silently evict queued "
            "requests; set `maxmemory-policy noeviction` (CONFIG SET or redis.conf) or use "
            "another server"
        )


def describe_connection_error(exc: BaseException, url: str = "") -> str:
    where = redact(url) if url else "the configured server"
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, RedisRefused):
        return f"Redis at {where} cannot serve now ({text}); try again when it can"
    if "certificate" in text.lower() or "ssl" in text.lower():
        return (
            f"TLS handshake with Redis at {where} failed ({text}); check the CA "
            "(ssl_ca_certs / BATCHGEN_REDIS_CA) and the server certificate"
        )
    return f"cannot reach Redis at {where} ({text}); is it running? Pass --redis URL or set {REDIS_URL.name}"


def is_oom(exc: BaseException) -> bool:
    return refusal_code(exc) == "OOM"


def queue_full(done: int, total: int, resume_hint: str) -> QueueFull:
    return QueueFull(
        f"queue full: Redis is out of memory (maxmemory, noeviction) after {done} of {total} "
        f"requests were enqueued. Start workers to drain the queue or raise maxmemory, "
        f"then {resume_hint}"
    )
