"""A batch's lifecycle: its states, the moves between them, and the script every move runs.

::

    validating ──▶ submitted ──window passed──▶ expiring ──▶ expired
       │  ▲           │  └──────────▶ completed ◀──────┘
       ▼  │           └──────────▶ cancelled
    cancelling ──(not submitted)──▶ cancelled
    validating, cancelling, submitted, expiring ──▶ failed

``BatchState`` is stored in the batch record (``state``) as its value. Once
submitted, what OpenAI's client sees follows the batch's job (batch_record.status)
until the server has written the output files, which moves the batch to a final
state: the job's Redis state may expire after that, the batch stays. Every move is
one script that checks ``MOVES`` against the state stored, so two threads (or
servers) moving one batch at once cannot undo each other: one of them is refused and
sees what the batch became.
"""

from __future__ import annotations

import enum

import redis

from batchgen.jobs.redis.keys import text
from batchgen.jobs.redis.lua import LuaScript, lua_moves


class BatchState(str, enum.Enum):
    """Stored in Redis as its value."""

    VALIDATING = "validating"  # its input file is checked, then submitted as a job
    CANCELLING = "cancelling"  # cancelled while validating: its job is not run
    SUBMITTED = "submitted"  # its job runs (same id)
    EXPIRING = "expiring"  # its window passed: the job's unfinished requests were cancelled
    COMPLETED = "completed"  # output files written (as are the three below)
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    FAILED = "failed"  # its input was refused, or its job was lost (errors say which)

    @property
    def final(self) -> bool:
        """Its output files are written: the batch no longer looks at its job."""
        return self in (BatchState.COMPLETED, BatchState.CANCELLED, BatchState.EXPIRED)

    @property
    def has_job(self) -> bool:
        """Its job runs, or ran and the output files are not written yet."""
        return self in (BatchState.SUBMITTED, BatchState.EXPIRING)

    @property
    def validating(self) -> bool:
        return self in (BatchState.VALIDATING, BatchState.CANCELLING)


MOVES: dict[BatchState, frozenset[BatchState]] = {
    BatchState.VALIDATING: frozenset(
        {BatchState.CANCELLING, BatchState.SUBMITTED, BatchState.FAILED}
    ),
    BatchState.CANCELLING: frozenset(
        {BatchState.SUBMITTED, BatchState.CANCELLED, BatchState.FAILED}
    ),
    BatchState.SUBMITTED: frozenset(
        {BatchState.EXPIRING, BatchState.COMPLETED, BatchState.CANCELLED, BatchState.FAILED}
    ),
    BatchState.EXPIRING: frozenset({BatchState.COMPLETED, BatchState.EXPIRED, BatchState.FAILED}),
    BatchState.COMPLETED: frozenset(),
    BatchState.CANCELLED: frozenset(),
    BatchState.EXPIRED: frozenset(),
    BatchState.FAILED: frozenset(),
}


MOVE = LuaScript.define(
    "move batch",
    keys=[("batch", "the batch record")],
    args=[("to", "the state to move to"), ("*fields", "other fields to set: name, value, ...")],
    prelude=f"local MOVES = {lua_moves(MOVES)}\n",
    body="""
local from = redis.call('HGET', batch, 'state')
if not from or not MOVES[from] or not MOVES[from][to] then return {0, from or ''} end
redis.call('HSET', batch, 'state', to, unpack(fields))
return {1, from}
""",
)


def move(
    conn: redis.Redis, key: str, to: BatchState, fields: dict[str, str]
) -> tuple[bool, BatchState | None]:
    """Move the batch stored at ``key`` to ``to`` and set ``fields``, if ``MOVES`` allows
    it from its stored state: (moved, the state it was in; None when there is none)."""
    moved, was = MOVE(conn, batch=key, to=to.value,
                      fields=[x for item in fields.items() for x in item])  # fmt: skip
    was = text(was)
    return bool(moved), BatchState(was) if was else None
