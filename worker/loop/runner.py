"""The queue loop: keep the engine's in-flight set full from the stream, commit rows.

Each tick: upkeep (heartbeat, refresh, reclaim, cancel poll, sweep; each on its
own interval), read at most ``free_capacity()`` new entries (blocking on Redis
only when the engine is idle and nothing waits to be committed), admit them,
run one engine step, and flush the sink when due. Requests that cannot run
become error rows. On SIGTERM/SIGINT it stops admitting, commits finished
rows, hands unfinished requests back with their tokens so far, and exits
within ``drain_timeout_s``.

Isolation (bisection of a failing step, last-chance suspects running alone)
is ``isolation.Isolation``; an engine that failed on a lone request exits
with ``ENGINE_FAILED_EXIT`` so that the supervisor starts a fresh engine (an
error may have left this one broken).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis

from batchgen.jobs.keys import Keys
from batchgen.jobs.queue import Delivery, HandBack, hand_back, read_new
from batchgen.jobs.rows import from_dict
from batchgen.jobs.sink import PartSink
from batchgen.jobs.submit import ensure_group
from batchgen.jobs.tasks import enqueue_finalize
from batchgen.worker.loop.config import ENGINE_FAILED_EXIT, LoopConfig
from batchgen.worker.loop.engine_api import EngineAPI
from batchgen.worker.loop.flight import Flight, error_row, now_ms, output_row
from batchgen.worker.loop.isolation import Isolation
from batchgen.worker.loop.keeper import Keeper
from batchgen.worker.loop.outages import StorageOutages
from batchgen.worker.loop.upkeep import LoopView, Upkeep

log = logging.getLogger(__name__)
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class QueueLoop:
    def __init__(self, conn: redis.Redis, api: EngineAPI, config: LoopConfig) -> None:
        self.conn = conn
        self.api = api
        self.engine = api.engine
        self.config = config
        self.keys = Keys(config.prefix)
        self.qk = self.keys.queue_for_model(config.model)
        self.inflight: dict[str, Flight] = {}  # entry id (= engine request id) -> flight
        self.isolation = Isolation()
        self.outages = StorageOutages(
            conn, self.qk, config.name, config.storage_outage_s, self._count
        )
        self.engine_failed = False
        self.engine_error = ""  # what the failed step raised, kept with the hand-backs
        self.sink = PartSink(
            self.qk,
            config.name,
            flush_rows=config.flush_rows,
            flush_interval_s=config.flush_interval_s,
        )
        self.upkeep = Upkeep(
            conn,
            self.keys,
            self.qk,
            config,
            LoopView(
                admit=self.admit,
                capacity=self.reclaim_capacity,
                count=self._count,
                activity=self.activity,
                stopping=lambda: self.stopping,
            ),
        )
        self.keeper = Keeper(conn, self.keys, self.qk, config)
        self.cancelled: set[str] = set()  # jobs whose requests this loop no longer runs
        self.cancel_seen: dict[str, int] = {}  # job -> unix ms this loop learned of its cancel
        self.rejections: tuple[type[BaseException], ...] = (*api.rejected, ValueError)
        self.stopping = False
        self.finished_jobs = False  # the last flush completed a job (``until`` may hold now)
        self.counters: dict[str, int] = {}
        self._backoff_until = 0.0
        self._backoff_s = 0.1

    # -- running ---------------------------------------------------------------

    def run(self, until: Callable[[], bool] | None = None) -> int:
        """Serve the queue until stopped (or drained in burst mode, or ``until()``)."""
        self._install_signals()
        ensure_group(self.conn, self.qk)
        self.conn.hset(self.keys.queues, self.qk.tag, self.upkeep.queue_name)
        self.start_keeper()
        try:
            while not self.stopping:
                try:
                    read = self.tick()
                except _REDIS_DOWN as exc:  # beyond the client's own retries: wait, go on
                    self._redis_down(exc)
                    time.sleep(min(self._backoff_s, 1.0))
                    continue
                idle = not self.inflight and self.sink.empty and read == 0
                if idle and self.config.burst and self.upkeep.drained():
                    break
                check = self.finished_jobs or self.upkeep.due("until", 0.25)
                self.finished_jobs = False
                if until is not None and check and until():
                    break
        finally:
            self.shutdown()
        return ENGINE_FAILED_EXIT if self.engine_failed else 0

    def stop(self, *_: object) -> None:
        if self.stopping:  # a second signal: leave now; entries stay pending, get reclaimed
            raise SystemExit(130)
        self.stopping = True

    def tick(self) -> int:
        """One iteration; how many entries were read."""
        self._sync_keeper()
        self.upkeep.run()
        read = 0
        block = None
        if self.isolation.waiting and not self.inflight and not self.stopping:
            self._start_alone()
        capacity = 0 if self.isolation.busy else self.engine.free_capacity()
        if capacity > 0 and not self.stopping and time.monotonic() >= self._backoff_until:
            idle = not self.engine.has_unfinished() and self.sink.empty
            block = self.config.block_ms if idle else None
            try:
                deliveries = read_new(self.conn, self.qk, self.config.name, capacity, block)
                self._redis_ok()
            except _REDIS_DOWN as exc:
                self._redis_down(exc)
                deliveries = []
            read = len(deliveries)
            if deliveries:  # a cancel that happened before this read must be seen now
                self._cancel_jobs(self.keeper.poll_cancelled())
            self.admit(deliveries)
        stepped = False
        self._cancel_jobs(self.keeper.cancelled)  # heard while admitting: before the step
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                if self._bisect(error):
                    return read
                log.exception("engine step failed; handing the in-flight requests back, exiting")
                self.engine_failed = self.stopping = True
                self.engine_error = error
                return read
            for out in outputs:
                self.finished(out)
            stepped = True
        if self.sink.due(idle=not self.engine.has_unfinished() and read == 0):
            self.flush()
        elif not stepped and read == 0 and block is None:
            time.sleep(0.01)  # nothing ran and nothing blocked: do not spin
        return read

    # -- requests --------------------------------------------------------------

    def admit(self, deliveries: list[Delivery]) -> None:
        suspects: list[Delivery] = []
        for d in deliveries:
            job = self.upkeep.job(d.job_id)
            if job is None or d.job_id in self.cancelled:
                self.sink.drop([d.entry_id])
                self._count("dropped")
                continue
            if d.failed_attempts > self.config.max_attempts:
                last = f"; last error: {d.last_error}" if d.last_error else ""
                self.upkeep.dead_letter(
                    d,
                    f"delivered {d.failed_attempts} times (max_attempts {self.config.max_attempts}); "
                    f"the worker running it stopped every time{last}",
                )
                continue
            if 1 < d.failed_attempts == self.config.max_attempts:
                suspects.append(d)  # its last chance: alone, so it fails by itself
                continue
            self._start(d, job.output)
        if suspects:
            self._isolate(suspects)

    def _isolate(self, suspects: list[Delivery]) -> None:
        """Keep one suspect to run alone; hand the others back as they came."""
        others = self.isolation.suspects(suspects)
        if not others:
            return
        items = [HandBack(d, list(d.resume), ran=False) for d in others]
        try:
            self._count("deferred", hand_back(self.conn, self.qk, self.config.name, items))
        except _REDIS_DOWN as exc:  # keep them (refreshed) and run them alone, in turn
            log.warning("could not hand suspects back (%s); they wait here", exc)
            self.isolation.wait_alone(others)

    def _start_alone(self) -> None:
        for d in self.isolation.next_set():
            job = self.upkeep.job(d.job_id)
            if job is None or d.job_id in self.cancelled:
                self.sink.drop([d.entry_id])
                continue
            self._start(d, job.output)
            if d.entry_id in self.inflight:
                self.isolation.started(d.entry_id)

    def _bisect(self, error: str) -> bool:
        """After a failed step: drop the engine's requests and queue the in-flight
        set to run again in two halves. False when there is nothing to halve (the
        culprit is the one request left) or the engine cannot even let go."""
        if self.stopping or len(self.inflight) < 2:
            return False
        try:
            outputs = {out.request_id: out for out in self.engine.drain()}
        except Exception:
            log.exception("engine drain failed after a failed step")
            return False
        deliveries = []
        for entry_id, flight in self.inflight.items():
            d, out = flight.delivery, outputs.get(entry_id)
            if out is not None:  # keep what it generated before the failed step
                d = replace(d, resume=list(out.token_ids),
                            preemptions=d.preemptions + out.num_preemptions)  # fmt: skip
            deliveries.append(d)
        self.inflight.clear()
        self.isolation.bisect(deliveries)
        log.warning(
            "engine step failed (%s); running its %d requests again in halves to find the culprit",
            error,
            len(deliveries),
        )
        self._count("bisections")
        return True

    def _start(self, d: Delivery, output: str) -> None:
        if d.finished is not None:  # made before its storage failed: only its part is missing
            self.sink.add(d, output, from_dict(d.finished))
            self._count("rows_carried")
            return
        try:
            params = self.api.sampling_params(**d.request["s"])
        except (TypeError, ValueError) as exc:
            return self._error(d, output, f"invalid sampling parameters: {exc}")
        prompt = d.request["p"] if "p" in d.request else d.request["m"]
        try:
            token_ids = self.engine.encode(prompt)
        except Exception as exc:  # a tokenizer or chat-template failure fails this row only
            return self._error(d, output, f"cannot tokenize the prompt: {exc}")
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            return self._error(
                d,
                output,
                f"prompt is {len(token_ids)} tokens; the model's context is {limit} tokens",
                len(token_ids),
            )
        try:
            self.engine.add_request(
                d.entry_id, token_ids, params, resume_token_ids=d.resume or None
            )
        except self.rejections as exc:
            reason = getattr(exc, "reason", None) or str(exc)
            return self._error(d, output, f"request rejected: {reason}", len(token_ids))
        self.inflight[d.entry_id] = Flight(d, output, len(token_ids))

    def _error(self, d: Delivery, output: str, message: str, prompt_tokens: int = 0) -> None:
        row = error_row(d, message, self.config.name, prompt_tokens)
        self.sink.add(d, output, row)
        self._count("rows_error")

    def finished(self, out) -> None:
        self.isolation.forget(out.request_id)
        flight = self.inflight.pop(out.request_id, None)
        if flight is None:
            return  # aborted meanwhile (cancelled, or claimed by another worker)
        row = output_row(flight, out, self.config.name)
        self.sink.add(flight.delivery, flight.output, row)
        self._count("rows_error" if row.failed else "rows_ok")
        self._count("prompt_tokens", row.prompt_tokens)
        self._count("generation_tokens", row.completion_tokens)

    def abort(self, entry_id: str) -> None:
        self.isolation.forget(entry_id)
        if self.inflight.pop(entry_id, None) is not None:
            self.engine.abort(entry_id)

    # -- what the keeper thread learned -------------------------------------------

    def start_keeper(self) -> None:
        """Start the thread that keeps claims and heartbeat fresh and hears cancels (once)."""
        if self.keeper.ident is None:
            self._sync_keeper(beat=True)
            self.keeper.start()

    def _sync_keeper(self, beat: bool = False) -> None:
        """Hand the keeper what we hold (and the heartbeat when due); take what it heard."""
        self.keeper.held = (*self.inflight, *self.isolation.held(), *self.sink.entry_ids())
        if beat or self.upkeep.due("heartbeat", self.config.heartbeat_s / 2):
            self.keeper.payload = self.upkeep.payload()
        stolen = self.keeper.take_stolen()
        if stolen:
            self._release(stolen)
        self._cancel_jobs(self.keeper.cancelled)

    def _release(self, entry_ids: set[str]) -> None:
        """Another worker claimed these while we were stalled: they are theirs now."""
        held = [e for e in entry_ids if e in self.inflight or e in self.isolation.held()]
        self.isolation.remove(lambda d: d.entry_id not in entry_ids)
        for entry_id in held:
            self.abort(entry_id)
        self._count("stolen", len(held))

    def _cancel_jobs(self, job_ids: frozenset[str]) -> None:
        """Abort the requests of newly cancelled jobs and drop their entries (no rows).

        A job leaves the cancelled set once none of its entries remain: forgotten here."""
        new = job_ids - self.cancelled
        if len(self.cancelled) > len(job_ids) - len(new):
            for job_id in self.cancelled - job_ids:
                self.cancel_seen.pop(job_id, None)
            self.cancelled &= job_ids
        if not new:
            return
        self.cancelled |= new
        now = now_ms()
        for job_id in new:
            self.cancel_seen[job_id] = now
        doomed = [e for e, f in self.inflight.items() if f.delivery.job_id in new]
        for entry_id in doomed:
            self.abort(entry_id)
        doomed += self.isolation.remove(lambda d: d.job_id not in new)
        if doomed:
            self.sink.drop(doomed)
            self._count("dropped", len(doomed))
        log.info("jobs %s cancelled: aborted %d requests here", sorted(new), len(doomed))

    # -- what upkeep sees (LoopView) ---------------------------------------------

    def reclaim_capacity(self) -> int:
        """How many idle entries to take over now (none while a set must run alone)."""
        return 0 if self.isolation.busy else self.engine.free_capacity()

    def activity(self) -> dict[str, Any]:
        """The loop's part of the heartbeat: requests held per job, rows, counters, engine."""
        in_flight: dict[str, int] = {}
        for flight in self.inflight.values():
            job_id = flight.delivery.job_id
            in_flight[job_id] = in_flight.get(job_id, 0) + 1
        stats = self.engine.stats()
        engine = (
            dataclasses.asdict(stats)
            if dataclasses.is_dataclass(stats) and not isinstance(stats, type)
            else {}
        )
        return {
            "in_flight": in_flight,
            "cancels": dict(self.cancel_seen),
            "buffered_rows": self.sink.buffered,
            "counters": dict(self.counters),
            "engine": engine,
        }

    # -- Redis steps -----------------------------------------------------------

    def flush(self) -> bool:
        flushed = self.sink.flush(self.conn)
        for job_id in self.outages.update(self.sink, flushed.recovered):
            self._hand_back_job(job_id)
        if flushed.redis_failed:
            self._redis_down(RuntimeError("commit failed"))
            return False
        self._redis_ok()
        result = flushed.commit
        if result is None:
            return True
        self._count("commits")
        self._count("rows_lost_to_duplicates", result.lost)
        for job_id in result.missing:
            log.error("job %s is gone from Redis (state lost?); dropped its rows", job_id)
        for job_id in result.finished:
            enqueue_finalize(self.conn, self.keys, self.qk, job_id)
        self.finished_jobs = bool(result.finished)
        return True

    def _hand_back_job(self, job_id: str) -> None:
        """Its output failed past the limit: hand back, uncharged, all this worker holds of it."""
        failure = self.sink.failing[job_id]
        rows = [HandBack(d, list(row.token_ids), row=row) for d, row in self.sink.rows(job_id)]
        try:
            handed = hand_back(self.conn, self.qk, self.config.name, rows)
            self.sink.take(job_id)
            running = []
            for entry_id, flight in list(self.inflight.items()):
                if flight.delivery.job_id == job_id:
                    out = self.engine.abort(entry_id)
                    del self.inflight[entry_id]
                    self.isolation.forget(entry_id)
                    tokens = list(out.token_ids) if out else list(flight.delivery.resume)
                    running.append(HandBack(flight.delivery, tokens))
            handed += hand_back(self.conn, self.qk, self.config.name, running)
        except _REDIS_DOWN as exc:  # kept (or pending here); tried again after the next flush
            log.warning("could not hand job %s's requests back (%s)", job_id, exc)
            return
        self.outages.handed_back(job_id, failure, handed)

    def shutdown(self) -> None:
        """Stop admitting; commit what finished; hand back what did not; retire."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        try:
            outputs = self.engine.drain() if self.engine.has_unfinished() else []
        except Exception:
            log.exception("engine drain failed; handing requests back without their new tokens")
            outputs = []
        while not self.sink.empty and time.monotonic() < deadline and not self.flush():
            time.sleep(0.2)
        self.sink.crash.reached("before_hand_back")
        failed = self.engine_failed  # the engine raised: this attempt counts as a failure
        error = self.engine_error
        items = []
        for out in outputs:
            flight = self.inflight.pop(out.request_id, None)
            if flight is not None:
                tokens = list(out.token_ids)
                items.append(
                    HandBack(flight.delivery, tokens, out.num_preemptions, failed, error=error)
                )
        for flight in self.inflight.values():  # the engine could not say: tokens as received
            d = flight.delivery
            items.append(HandBack(d, list(d.resume), 0, failed, error=error))
        self.inflight.clear()
        items += self.isolation.hand_backs()
        for job_id in list(self.sink.failing):  # finished, but their parts cannot be written
            items += [
                HandBack(d, list(row.token_ids), row=row) for d, row in self.sink.take(job_id)
            ]
        while items and time.monotonic() < deadline:
            try:
                self._count("handed_back", hand_back(self.conn, self.qk, self.config.name, items))
                break
            except _REDIS_DOWN as exc:
                log.warning("hand-back failed (%s); retrying until the drain timeout", exc)
                time.sleep(0.2)
        self.keeper.stop()
        self.upkeep.retire()

    # -- helpers ---------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _redis_down(self, exc: BaseException) -> None:
        log.warning("Redis unavailable (%s); retrying in %.1fs", exc, self._backoff_s)
        self._backoff_until = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, 5.0)

    def _redis_ok(self) -> None:
        self._backoff_s = 0.1

    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            # Ctrl-C in a terminal hits the whole process group; under a supervisor
            # the SIGTERM it forwards is the one to act on (a second would be "now").
            sigint = signal.SIG_IGN if self.config.supervised else self.stop
            signal.signal(signal.SIGINT, sigint)
