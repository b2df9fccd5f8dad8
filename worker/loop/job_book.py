"""The jobs a worker meets: what it needs of each (read once), and its dead letters.

A job's output and result cache, and whether this worker holds the weights it
was submitted for (the job's fingerprint, set at submit or else by the first
worker); an entry delivered too often ends here as a dead-lettered error row.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import redis

from batchgen.jobs.ops.finalize.finalize_tasks import enqueue_finalize
from batchgen.jobs.ops.modelinfo import fingerprint
from batchgen.jobs.redis.keys import Keys, QueueKeys, text
from batchgen.jobs.schema import reasoning, tool_parsers
from batchgen.jobs.schema.reasoning import ReasoningParser
from batchgen.jobs.schema.rows import Row
from batchgen.jobs.schema.tool_parsers import ToolParser
from batchgen.worker.consumer.queue import Delivery, dead_letter
from batchgen.worker.loop.flight import error_row
from batchgen.worker.loop.loop_config import LoopConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class JobInfo:
    output: str
    cache: str = ""  # the result cache's location when the job uses it
    refused: str = ""  # why this worker will not run the job's requests (other weights)
    reasoning: ReasoningParser | None = None  # splits each output into reasoning and answer
    tool_parser: ToolParser | None = None  # finds the calls of tool_choice auto rows


class JobBook:
    def __init__(
        self,
        conn: redis.Redis,
        keys: Keys,
        qk: QueueKeys,
        config: LoopConfig,
        count: Callable[[str, int], None],
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.qk = qk
        self.config = config
        self.count = count
        self.jobs: dict[str, JobInfo | None] = {}  # None: the job's record is gone
        self.fingerprint = fingerprint(config.model)

    def job(self, job_id: str) -> JobInfo | None:
        """The job's output, and whether this worker holds the weights it was submitted
        for (the job's fingerprint, set at submit or else by the first worker)."""
        if job_id not in self.jobs:
            jk = self.qk.job(job_id)
            pipe = self.conn.pipeline(transaction=False)
            pipe.hmget(jk.job, ["output", "cache", "reasoning_parser", "tool_call_parser",
                                "refused"])  # fmt: skip
            if self.fingerprint:
                pipe.hsetnx(jk.job, "model_fingerprint", self.fingerprint)
            pipe.hget(jk.job, "model_fingerprint")
            (output, cache, parser_name, tool_name, other), *_, expected = pipe.execute()
            if output is None:
                self.jobs[job_id] = None
                return None
            refused = self._refusal(job_id, text(expected))
            if other and not refused:  # another worker's refusal: this one runs the job
                self.conn.hdel(jk.job, "refused")
            name, tool_name = text(parser_name), text(tool_name)
            self.jobs[job_id] = JobInfo(
                text(output), text(cache), refused, reasoning.parser(name) if name else None,
                tool_parsers.parser(tool_name) if tool_name else None,
            )  # fmt: skip
        return self.jobs[job_id]

    def _refusal(self, job_id: str, expected: str) -> str:
        """Why this worker must not run the job (it holds other weights under the same
        name), said on the job for status until a worker that may run it takes it; ""
        when this one may."""
        if not self.fingerprint or not expected or expected == self.fingerprint:
            return ""
        reason = (
            f"worker {self.config.name} on {socket.gethostname()} holds other weights for "
            f"{self.config.model} (fingerprint {self.fingerprint}; the job was submitted for "
            f"{expected}): it leaves the job's requests to workers that hold those"
        )
        log.error("refusing job %s: %s", job_id, reason)
        self.conn.hset(self.qk.job(job_id).job, "refused", reason)
        return reason

    def dead_letter(self, d: Delivery, reason: str) -> None:
        row = error_row(d, f"dead-lettered: {reason}", self.config.name)
        finished = dead_letter(self.conn, self.qk, d, reason, self.config.name, _row_json(row))
        self.count("dead_lettered", 1)
        if finished:
            enqueue_finalize(self.conn, self.keys, self.qk, d.job_id)


def _row_json(row: Row) -> str:
    return json.dumps(row.to_dict(), ensure_ascii=False)
