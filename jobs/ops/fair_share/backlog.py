"""A job's backlog: its requests waiting for a worker, in lists by prompt prefix.

Submit and retry append a job's requests here (``BACKLOG_PUSH`` in their chunk
scripts), not to the model's stream. When a worker has room, the dispatch script
(worker/consumer/dispatch.py) chooses a job by fair share and moves requests from its
backlog to the stream, where they are delivered to that worker in the same step:
the stream holds only what workers hold (and what they handed back), so a job
submitted behind a huge one is not behind it.

A backlog is ``BACKLOG_GROUPS`` lists (keys.py); a request goes to the list of
its prompt's first ``PREFIX_BYTES`` bytes (``prefix_group``), so requests that
share a long prefix (a system prompt, few-shot examples) share a list. Each
worker takes first from the lists rendezvous hashing gives it
(worker/loop/affinity.py), where its prefix cache already holds their prefix.

The job record's ``backlog`` counts what its lists hold; the model's ``ready``
set names the jobs whose backlog is not empty (dispatch removes a job once it
empties them), and fair_index.py keeps them in dispatch order. Cancel and delete
drop a job's backlog whole.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Mapping

import redis

from batchgen.jobs.ops.fair_share.fair_index import FAIR_INDEX
from batchgen.jobs.redis.keys import BACKLOG_GROUPS, QueueKeys, text
from batchgen.jobs.schema.entry import backlog_item, parse_backlog_item

PREFIX_BYTES = 256  # ~64 tokens: prompts that share this much likely share far more
# Where a request's prompt starts in its encoding (QueuedRequest.encode writes "id" first and
# then one of these); inside a JSON string a quote is always escaped, so a match is a key.
_STARTS = (b'{"p":', b',"p":', b'{"m":', b',"m":', b'{"e":', b',"e":')
_SAMPLING = b',"s":'

# Lua: append packed items to a job's backlog, count them, mark the job ready, enter it
# in the fair-share index and ring the workers (their keeper threads listen on the events
# channel).
BACKLOG_PUSH = (
    FAIR_INDEX
    + """
local function push_backlog(job, job_id, ready, events, backlogs, items)
  for k = 1, #items, 2 do redis.call('RPUSH', backlogs[tonumber(items[k]) + 1], items[k + 1]) end
  redis.call('HINCRBY', job, 'backlog', #items / 2)
  redis.call('SADD', ready, job_id)
  fx_enter(string.sub(ready, 1, #ready - 5), job, job_id)  -- ready is P:{TAG}:ready
  redis.call('PUBLISH', events, 'work')
end
"""
)


def prefix_group(request: bytes) -> int:
    """The backlog list of an encoded request: a hash of its prompt's first bytes."""
    start = min((i for i in map(request.find, _STARTS) if i >= 0), default=0)
    return zlib.crc32(request[start : start + PREFIX_BYTES]) % BACKLOG_GROUPS


def items(
    indexed: Iterable[tuple[int, bytes]], queued_ms: int | None = None,
    prior_runs: Mapping[int, int] | None = None,
) -> list[bytes]:  # fmt: skip
    """``push_backlog``'s items for (input index, encoded request) pairs: group, item, ...;
    ``prior_runs``: by input index, the deliveries that ran a request before (a retry's)."""
    now = int(time.time() * 1000) if queued_ms is None else queued_ms
    runs = prior_runs or {}
    out: list[bytes] = []
    for index, request in indexed:
        item = backlog_item(index, now, request, runs.get(index, 0))
        out += [b"%d" % prefix_group(request), item]
    return out


def estimate_input_tokens(request: bytes) -> int:
    """A request's input tokens as quotas count them before any tokenizer ran: a
    quarter of its encoding's bytes up to its sampling fields (OpenAI's rule of thumb)."""
    end = request.find(_SAMPLING)
    return ((end if end >= 0 else len(request)) + 3) // 4


def queued(conn: redis.Redis, qk: QueueKeys, job_id: str) -> list[tuple[int, int, bytes]]:
    """(input index, queued unix ms, encoded request) of every request in the job's
    backlog, by index."""
    pipe = conn.pipeline(transaction=False)
    for key in qk.job(job_id).backlogs:
        pipe.lrange(key, 0, -1)
    return sorted(parse_backlog_item(item) for lst in pipe.execute() for item in lst)


def total(conn: redis.Redis, qk: QueueKeys) -> int:
    """Requests waiting in the model's backlogs (the ready jobs' ``backlog`` counts)."""
    ids = [text(i) for i in conn.smembers(qk.ready)]
    if not ids:
        return 0
    pipe = conn.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(qk.job(job_id).job, "backlog")
    return sum(int(n or 0) for n in pipe.execute())
