"""The requests a worker runs: admission, the engine's in-flight set, isolation, rows.

Entries come in (``admit``): a job that is gone or cancelled is dropped, an
entry delivered more than ``max_attempts`` times is dead-lettered, a request
on its last chance is isolated (isolation.py), the rest start in the engine;
a request that cannot run becomes an error row; one of a job that uses the
result cache may be served from it (caching.py). Finished outputs become rows
in the sink. Cancels, entries another worker took over, a failed engine step
(bisection) and a shutdown or storage hand-back all change the in-flight set
here; the queue loop (queue_loop.py) does the Redis steps around it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import redis

from batchgen.jobs.schema import tools
from batchgen.jobs.schema.rows import Row, cached_input_tokens
from batchgen.worker.consumer.queue import Delivery, HandBack
from batchgen.worker.consumer.sink import PartSink
from batchgen.worker.loop.caching import LoopCache
from batchgen.worker.loop.engine_api import EngineAPI, EngineOutput
from batchgen.worker.loop.flight import (
    Flight,
    Reasoning,
    error_row,
    now_ms,
    output_row,
    resumable,
)
from batchgen.worker.loop.isolation import Isolation
from batchgen.worker.loop.job_book import JobInfo
from batchgen.worker.loop.loop_config import LoopConfig
from batchgen.worker.loop.progress import Progress

log = logging.getLogger(__name__)
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
# the prompt's last tokens, read for a reasoning end tag its template wrote (a closed one)
PROMPT_TAIL_TOKENS = 16
REFUSED_PAUSE_S = 1.0  # no reads this long after handing back a refused job's requests


class Requests:
    def __init__(
        self,
        api: EngineAPI[Any],
        sink: PartSink,
        config: LoopConfig,
        job: Callable[[str], JobInfo | None],  # a job's output, None if the job is gone
        dead_letter: Callable[[Delivery, str], None],
        hand_back: Callable[[list[HandBack]], int],  # raises while Redis is down
        count: Callable[[str, int], None],
        cache: LoopCache,
    ) -> None:
        self.cache = cache
        self.api = api
        self.engine = api.engine
        self.sink = sink
        self.config = config
        self.job = job
        self.dead_letter = dead_letter
        self.hand_back = hand_back
        self.count = count
        self.flights: dict[str, Flight] = {}  # entry id (= engine request id) -> flight
        self.isolation = Isolation()
        self.cancelled: set[str] = set()  # jobs whose requests this worker no longer runs
        self.cancel_seen: dict[str, int] = {}  # job -> unix ms this worker applied its cancel
        self.progress = Progress()  # tokens and rows per job as made here: the heartbeat's
        self.read_paused_until = 0.0  # monotonic: after refusing a job's requests
        self.rejections: tuple[type[BaseException], ...] = (*api.rejected, ValueError)

    def held(self) -> tuple[str, ...]:
        """Entries this worker holds: in flight, waiting to run alone, awaiting commit."""
        return (*self.flights, *self.isolation.held(), *self.sink.entry_ids())

    def per_job(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for flight in self.flights.values():
            counts[flight.delivery.job_id] = counts.get(flight.delivery.job_id, 0) + 1
        return counts

    def live_progress(self) -> dict[str, dict[str, float]]:
        """The heartbeat's ``progress`` (progress.py): the tokens each job's requests
        generated since the last call counted, and per job the tokens not committed yet
        (of the requests in the engine and of the rows awaiting commit) and the rates."""
        counts = self.engine.output_token_counts()
        pending = self.sink.uncommitted_tokens()
        for entry_id, flight in self.flights.items():
            job_id = flight.delivery.job_id
            tokens = counts.get(entry_id, flight.counted)
            if tokens > flight.counted:
                self.progress.generated(job_id, tokens - flight.counted)
                flight.counted = tokens
            held = pending.setdefault(job_id, [0, 0])
            held[0] += flight.prompt_tokens
            held[1] += tokens
        return self.progress.report(pending)

    def capacity(self) -> int:
        """How many more entries to take now (none while a set must run alone)."""
        return 0 if self.isolation.busy else self.engine.free_capacity()

    def admit_reclaimed(self, deliveries: list[Delivery], cancelled: frozenset[str]) -> None:
        """Entries taken over from a dead worker; ``cancelled``: the jobs cancelled now (a
        cancel before the claim must be seen).

        One this worker holds itself (it looked idle: the keeper was starved of CPU past
        the claim timeout) is ours already: claiming it only refreshed it."""
        held = set(self.held())
        self.cancel(cancelled)
        self.admit([d for d in deliveries if d.entry_id not in held])

    def admit(self, deliveries: list[Delivery]) -> None:
        suspects: list[Delivery] = []
        refused: list[Delivery] = []
        ready: list[tuple[Delivery, JobInfo]] = []
        for d in deliveries:
            job = self.job(d.job_id)
            if job is None or d.job_id in self.cancelled:
                self.sink.drop([d.entry_id])
                self.count("dropped", 1)
                continue
            if job.refused:
                refused.append(d)
                continue
            if d.failed_attempts > self.config.max_attempts:
                last = f"; last error: {d.last_error}" if d.last_error else ""
                self.dead_letter(
                    d,
                    f"delivered {d.failed_attempts} times (max_attempts {self.config.max_attempts}); "
                    f"the worker running it stopped every time{last}",
                )
                continue
            if 1 < d.failed_attempts == self.config.max_attempts:
                suspects.append(d)  # its last chance: alone, so it fails by itself
                continue
            ready.append((d, job))
        self.start_all(ready)
        if suspects:
            self._isolate(suspects)
        if refused:
            self._refuse(refused)

    def _refuse(self, deliveries: list[Delivery]) -> None:
        """Requests of a job submitted for other weights: back to the stream, uncharged,
        for a worker that holds them; this one pauses its reads so it does not spin on them."""
        items = [HandBack(d, list(d.resume), ran=False) for d in deliveries]
        try:
            self.count("refused", self.hand_back(items))
        except REDIS_DOWN as exc:  # still pending here: reclaimed once the claim times out
            log.warning("could not hand back a refused job's requests (%s)", exc)
        self.read_paused_until = time.monotonic() + REFUSED_PAUSE_S

    def _isolate(self, suspects: list[Delivery]) -> None:
        """Keep one suspect to run alone; hand the others back as they came."""
        others = self.isolation.suspects(suspects)
        if not others:
            return
        items = [HandBack(d, list(d.resume), ran=False) for d in others]
        try:
            self.count("deferred", self.hand_back(items))
        except REDIS_DOWN as exc:  # keep them (refreshed) and run them alone, in turn
            log.warning("could not hand suspects back (%s); they wait here", exc)
            self.isolation.wait_alone(others)

    def start_alone(self) -> None:
        for d in self.isolation.next_set():
            job = self.job(d.job_id)
            if job is None or d.job_id in self.cancelled:
                self.sink.drop([d.entry_id])
                continue
            self.start_all([(d, job)], cached=False)  # alone: it runs in the engine
            if d.entry_id in self.flights:
                self.isolation.started(d.entry_id)

    def bisect(self, error: str) -> bool:
        """After a failed step: drop the engine's requests and queue the in-flight
        set to run again in two halves. False when there is nothing to halve (the
        culprit is the one request left) or the engine cannot even let go."""
        if len(self.flights) < 2:
            return False
        try:
            outputs = {out.request_id: out for out in self.engine.drain()}
        except Exception:
            log.exception("engine drain failed after a failed step")
            return False
        deliveries = []
        for entry_id, flight in self.flights.items():
            d, out = flight.delivery, outputs.get(entry_id)
            if out is not None:  # keep what it generated before the failed step
                d = replace(d, resume=list(out.token_ids),
                            preemptions=d.preemptions + out.num_preemptions)  # fmt: skip
            deliveries.append(d)
        self.flights.clear()
        self.isolation.bisect(deliveries)
        log.warning(
            "engine step failed (%s); running its %d requests again in halves to find the culprit",
            error,
            len(deliveries),
        )
        self.count("bisections", 1)
        return True

    def start_all(self, items: list[tuple[Delivery, JobInfo]], cached: bool = True) -> None:
        """Start each in the engine, or serve it from the result cache (``cached``: look up
        the requests of jobs that use it, all at once)."""
        ready = []
        for d, job in items:
            prepared = self._prepare(d, job.output)
            if prepared is not None:
                ready.append((d, job, *prepared))
        lookups = [(job, d, ids) for d, job, _, ids in ready if job.cache and cached]
        hits = self.cache.lookup(lookups) if lookups else {}
        for d, job, params, token_ids in ready:
            row = hits.get(d.entry_id)
            if row is not None:
                self.emit(d, job.output, row)
                self.count("rows_cached", 1)
                continue
            reasoning = None
            if job.reasoning is not None:
                tail = self.engine.decode(token_ids[-PROMPT_TAIL_TOKENS:])
                reasoning = Reasoning(job.reasoning, job.reasoning.closed_by(tail))
            unclosed = reasoning.unclosed if reasoning is not None else None
            try:  # a constraint (a forced call's too) applies to the answer after the reasoning
                self.engine.add_request(d.entry_id, token_ids, params,
                                        resume_token_ids=d.resume or None, reasoning=unclosed)  # fmt: skip
            except self.rejections as exc:
                self.cache.forget(d.entry_id)
                reason = getattr(exc, "reason", None) or str(exc)
                self.error(d, job.output, f"request rejected: {reason}", len(token_ids))
                continue
            flight = Flight(d, job.output, len(token_ids), counted=len(d.resume))
            flight.reasoning = reasoning
            kind = tools.kind(d.request.tool_choice) if d.request.tools is not None else ""
            if kind == "auto":
                flight.tool_parser = job.tool_parser
            self.flights[d.entry_id] = flight
            self.progress.started(d.job_id)

    def _prepare(self, d: Delivery, output: str) -> tuple[Any, list[int]] | None:
        """(sampling params, prompt token ids) of a request to run; None when it was
        dealt with here (a carried row, an embedding, an error row)."""
        if d.finished is not None:  # made before its storage failed: only its part is missing
            self.sink.add(d, output, d.finished)
            self.count("rows_carried", 1)
            return None
        if d.request.invalid is not None:  # skipped at submit: its row says why
            self.error(d, output, d.request.invalid)
            return None
        if d.request.embed is not None:
            self._start_embedding(d, output, d.request.embed)
            return None
        prompt = d.request.prompt_input
        if prompt is None:
            self.error(d, output, "the queue entry holds no prompt, messages or input")
            return None
        try:
            params = self.api.sampling_params(**(d.request.sampling or {}))
        except (TypeError, ValueError) as exc:
            self.error(d, output, f"invalid sampling parameters: {exc}")
            return None
        try:
            token_ids = self.engine.encode(prompt, d.request.template_kwargs, d.request.tools)
        except Exception as exc:  # a tokenizer or chat-template failure fails this row only
            self.error(d, output, f"cannot tokenize the prompt: {exc}")
            return None
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            message = f"prompt is {len(token_ids)} tokens; the model's context is {limit} tokens"
            self.error(d, output, message, len(token_ids))
            return None
        return params, token_ids

    def _start_embedding(self, d: Delivery, output: str, embed: str | list[int]) -> None:
        """An embedding entry: no sampling, no partial tokens (a hand-back restarts it)."""
        try:
            self.engine.add_embedding(d.entry_id, embed, d.request.dimensions)
        except self.rejections as exc:
            reason = getattr(exc, "reason", None) or str(exc)
            return self.error(d, output, f"request rejected: {reason}")
        self.flights[d.entry_id] = Flight(d, output)
        self.progress.started(d.job_id)

    def error(self, d: Delivery, output: str, message: str, prompt_tokens: int = 0) -> None:
        row = error_row(d, message, self.config.name, prompt_tokens)
        self.emit(d, output, row)
        self.count("rows_error", 1)

    def emit(self, d: Delivery, output: str, row: Row, engine_us: int = 0) -> None:
        """A row made here, to the sink; its usage to this worker's own counters (which
        the jobs' committed usage adds up to)."""
        self.sink.add(d, output, row, engine_us)
        self.progress.made_row(d.job_id)
        self.count("prompt_tokens", row.prompt_tokens)
        self.count("cached_tokens", cached_input_tokens(row))
        self.count("generation_tokens", row.completion_tokens)
        self.count("reasoning_tokens", row.reasoning_tokens or 0)
        self.count("engine_us", engine_us)

    def charge_step(self, elapsed_s: float) -> None:
        """An engine step took ``elapsed_s``: each request in the engine bears an equal share."""
        if not self.flights:
            return
        share = int(elapsed_s * 1e6) // len(self.flights)
        for flight in self.flights.values():
            flight.engine_us += share

    def finished(self, out: EngineOutput) -> None:
        self.isolation.forget(out.request_id)
        flight = self.flights.pop(out.request_id, None)
        if flight is None:
            return  # aborted meanwhile (cancelled, or claimed by another worker)
        row = output_row(flight, out, self.config.name, self.engine.token_text, self.engine.decode)
        self.progress.generated(flight.delivery.job_id, row.completion_tokens - flight.counted)
        self.cache.finished(out.request_id, row)
        self.emit(flight.delivery, flight.output, row, flight.engine_us)
        self.count("rows_error" if row.failed else "rows_ok", 1)

    def abort(self, entry_id: str) -> None:
        self.isolation.forget(entry_id)
        self.cache.forget(entry_id)
        if self.flights.pop(entry_id, None) is not None:
            self.engine.abort(entry_id)

    def release(self, entry_ids: set[str]) -> None:
        """Another worker claimed these while we were stalled: they are theirs now."""
        held = [e for e in entry_ids if e in self.flights or e in self.isolation.held()]
        self.isolation.remove(lambda d: d.entry_id not in entry_ids)
        for entry_id in held:
            self.abort(entry_id)
        self.count("stolen", len(held))

    def cancel(self, job_ids: frozenset[str]) -> None:
        """Abort the requests of newly cancelled jobs and drop their entries (no rows).

        A job leaves the cancelled set once none of its entries remain: forgotten here."""
        gone = self.cancelled - job_ids
        for job_id in gone:
            self.cancel_seen.pop(job_id, None)
        self.cancelled -= gone
        new = job_ids - self.cancelled
        if not new:
            return
        self.cancelled |= new
        now = now_ms()
        for job_id in new:
            self.cancel_seen[job_id] = now
        doomed = [e for e, f in self.flights.items() if f.delivery.job_id in new]
        for entry_id in doomed:
            self.abort(entry_id)
        doomed += self.isolation.remove(lambda d: d.job_id not in new)
        if doomed:
            self.sink.drop(doomed)
            self.count("dropped", len(doomed))
        log.info("jobs %s cancelled: aborted %d requests here", sorted(new), len(doomed))

    def take_job(self, job_id: str) -> list[HandBack]:
        """Everything of a job it runs, out of the engine: to hand back uncharged."""
        items = []
        for entry_id, flight in list(self.flights.items()):
            if flight.delivery.job_id == job_id:
                out = self.engine.abort(entry_id)
                del self.flights[entry_id]
                self.isolation.forget(entry_id)
                tokens = list(out.token_ids) if out else list(flight.delivery.resume)
                items.append(HandBack(flight.delivery, resumable(flight.delivery, tokens)))
        return items

    def take_all(self, outputs: Sequence[EngineOutput], failed: bool, error: str) -> list[HandBack]:
        """Shutdown: every request it holds, to hand back. ``outputs``: the engine's drain;
        ``failed``: the engine raised, so this attempt counts as a failure."""
        items = []
        for out in outputs:
            flight = self.flights.pop(out.request_id, None)
            if flight is not None:
                tokens = resumable(flight.delivery, list(out.token_ids))
                items.append(
                    HandBack(flight.delivery, tokens, out.num_preemptions, failed, error=error)
                )
        for flight in self.flights.values():  # the engine could not say: tokens as received
            d = flight.delivery
            items.append(HandBack(d, list(d.resume), 0, failed, error=error))
        self.flights.clear()
        items += self.isolation.hand_backs()
        for job_id in list(self.sink.failing):  # finished, but their parts cannot be written
            items += [
                HandBack(d, list(row.token_ids), row=row) for d, row in self.sink.take(job_id)
            ]
        return items
