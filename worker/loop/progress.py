"""A worker's live progress per job, which its heartbeat carries.

A job's record counts rows when they commit, which for long generations is minutes
after their first tokens: status read from it alone showed 0 tokens and 0.0 tok/s
while 640 requests generated. The heartbeat (sent every few seconds anyway: nothing
is written per token) carries, per job this worker runs:

- ``prompt_tokens``, ``completion_tokens``: of its requests in the engine (tokens
  generated so far) and of its rows awaiting commit here; status adds them to the
  committed counts while the job runs;
- ``tokens_per_s``, ``rows_per_s``: completion tokens generated and rows made here,
  per second over the last ``WINDOW_S`` (or since this worker first ran one of the
  job's requests, when that is later), so a burst of rows committing together is
  neither a spike nor a stall. Status, its ETA and the dashboard's chart sum them
  over the live workers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_S = 60.0
MIN_SPAN_S = 1.0  # a rate over less time than this is over this (no spike at a job's start)


@dataclass(slots=True)
class _Job:
    tokens: int = 0  # completion tokens generated here (only grows)
    rows: int = 0  # rows made here (only grows)
    history: deque[tuple[float, int, int]] = field(default_factory=deque)  # (t, tokens, rows)


class Progress:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.jobs: dict[str, _Job] = {}

    def _job(self, job_id: str) -> _Job:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = _Job()
            job.history.append((self.clock(), 0, 0))  # its rates run from now
        return job

    def started(self, job_id: str) -> None:
        """One of the job's requests entered the engine here."""
        self._job(job_id)

    def generated(self, job_id: str, tokens: int) -> None:
        if tokens > 0:
            self._job(job_id).tokens += tokens

    def forget(self, job_id: str) -> None:
        """The job's rows are all in (its record counts them): nothing of it to report."""
        self.jobs.pop(job_id, None)

    def made_row(self, job_id: str) -> None:
        self._job(job_id).rows += 1

    def report(self, pending: dict[str, list[int]]) -> dict[str, dict[str, float]]:
        """Per job: ``pending`` (job -> [prompt, completion] tokens not committed yet) and
        the rates over the window. A job with nothing pending here and no tokens or rows
        in the window is forgotten."""
        now = self.clock()
        out: dict[str, dict[str, float]] = {}
        for job_id, job in list(self.jobs.items()):
            history = job.history
            history.append((now, job.tokens, job.rows))
            while len(history) > 1 and history[1][0] <= now - WINDOW_S:
                history.popleft()
            t0, tokens0, rows0 = history[0]
            span = max(now - t0, MIN_SPAN_S)
            tokens_per_s, rows_per_s = (job.tokens - tokens0) / span, (job.rows - rows0) / span
            if job_id not in pending and not tokens_per_s and not rows_per_s:
                del self.jobs[job_id]
                continue
            out[job_id] = {"tokens_per_s": round(tokens_per_s, 2),
                           "rows_per_s": round(rows_per_s, 3)}  # fmt: skip
        for job_id, (prompt, completion) in pending.items():
            rates = out.setdefault(job_id, {"tokens_per_s": 0.0, "rows_per_s": 0.0})
            rates.update(prompt_tokens=prompt, completion_tokens=completion)
        return out
