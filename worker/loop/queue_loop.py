"""The queue loop: keep the engine's in-flight set full from the stream, commit rows.

Each tick: take what the keeper thread heard (keeper.py: claims and heartbeat
kept fresh, cancels, work announced), upkeep (reclaim, sweep, deadlines), read
at most the engine's free capacity of new entries (the dispatch script chooses
them by fair share, this worker's prefix groups first: worker/consumer/dispatch.py,
affinity.py; when the engine is idle and nothing waits to be committed, an empty
read waits for work to be announced), admit them (requests.py), run one engine
step (its time shared by the requests in it, for usage), and flush the sink when
due. On SIGTERM/SIGINT it stops admitting,
commits finished rows, hands unfinished requests back with their tokens so
far, and exits within ``drain_timeout_s``.

An engine step that raises is bisected (isolation.py); an engine that failed
on a lone request exits with ``ENGINE_FAILED_EXIT`` so that the supervisor
starts a fresh engine (an error may have left this one broken). A job whose
parts cannot be written past ``storage_outage_s`` has its requests handed
back, uncharged (outages.py).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from batchgen.jobs.backoff import backoff_delay
from batchgen.jobs.ops.finalize.finalize_tasks import enqueue_finalize
from batchgen.jobs.redis.keys import Keys, queue_tag
from batchgen.jobs.redis.outage_probe import OutageLog
from batchgen.jobs.redis.stream import ensure_group
from batchgen.worker.consumer.queue import HandBack, hand_back, read_new
from batchgen.worker.consumer.sink import PartSink
from batchgen.worker.loop.affinity import Affinity
from batchgen.worker.loop.caching import LoopCache, numerics
from batchgen.worker.loop.engine_api import EngineAPI
from batchgen.worker.loop.job_book import JobBook
from batchgen.worker.loop.keeper import Keeper
from batchgen.worker.loop.loop_config import ENGINE_FAILED_EXIT, LoopConfig
from batchgen.worker.loop.outages import StorageOutages
from batchgen.worker.loop.requests import Requests
from batchgen.worker.loop.upkeep import Upkeep

log = logging.getLogger(__name__)
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class QueueLoop:
    def __init__(self, conn: redis.Redis, api: EngineAPI[Any], config: LoopConfig) -> None:
        self.conn = conn
        self.api = api
        self.engine = api.engine
        self.config = config
        self.keys = Keys(config.prefix)
        self.qk = self.keys.queue(queue_tag(config.queue_name))
        self.counters: dict[str, int] = {}  # first: every part below bumps them
        count = self._count
        self.outages = StorageOutages(conn, self.qk, config.name, config.storage_outage_s, count)
        self.engine_failed = False
        self.engine_error = ""  # what the failed step raised, kept with the hand-backs
        self.sink = PartSink(
            self.qk,
            config.name,
            flush_rows=config.flush_rows,
            flush_interval_s=config.flush_interval_s,
        )
        self.jobs = JobBook(conn, self.keys, self.qk, config, count)
        self.requests = Requests(
            api,
            self.sink,
            config,
            job=self.jobs.job,
            dead_letter=self.jobs.dead_letter,
            hand_back=lambda items: hand_back(conn, self.qk, config.name, items),
            count=count,
            cache=LoopCache(
                conn,
                self.keys,
                self.jobs.fingerprint,
                numerics(self.engine, config),
                config.name,
                count,
            ),
        )
        # an outage is logged once when it starts and once when it ends, whichever of the
        # loop, its upkeep and the keeper thread meets it (each retries on its own clock)
        self.redis_outage = OutageLog(log, "worker")
        self.keeper = Keeper(conn, self.keys, self.qk, config, self.redis_outage)
        self.upkeep = Upkeep(conn, self.keys, self.qk, config, self.requests, self.keeper, count,
                             self.redis_outage)  # fmt: skip
        self.affinity = Affinity(conn, self.keys, self.qk, config.name, config.heartbeat_s)
        self.stopping = False
        self.finished_jobs = False  # the last flush completed a job (``until`` may hold now)
        self._backoff_until = 0.0
        self._redis_failures = 0  # in a row; the next wait doubles with each

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
                    time.sleep(backoff_delay(self._redis_failures, 0.1, 1.0))
                    continue
                idle = not self.requests.flights and self.sink.empty and read == 0
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
        self.upkeep.run(self.stopping)
        read = 0
        block = None
        requests = self.requests
        if requests.isolation.waiting and not requests.flights and not self.stopping:
            requests.start_alone()
        capacity = requests.capacity()
        paused_until = max(self._backoff_until, requests.read_paused_until)
        if capacity > 0 and not self.stopping and time.monotonic() >= paused_until:
            idle = not self.engine.has_unfinished() and self.sink.empty
            block = self.config.block_ms if idle else None
            self.keeper.work.clear()  # before the read: work announced after it wakes us
            try:
                groups = self.affinity.groups() if self.config.prefix_affinity else None
                deliveries = read_new(self.conn, self.qk, self.config.name, capacity, groups)
                self._redis_ok()
            except _REDIS_DOWN as exc:
                self._redis_down(exc)
                deliveries = []
            if not deliveries and block is not None:
                self.keeper.work.wait(block / 1000)  # idle: until work is announced
            read = len(deliveries)
            if deliveries:  # a cancel that happened before this read must be seen now
                requests.cancel(self.keeper.poll_cancelled())
            requests.admit(deliveries)
        stepped = False
        requests.cancel(self.keeper.cancelled)  # heard while admitting: before the step
        # what the keeper keeps fresh while the step (however long) and the flush run
        self.keeper.held = requests.held()
        if self.engine.has_unfinished():
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                lost = isinstance(exc, self.api.lost)  # no step can run again: no bisection
                if not self.stopping and not lost and requests.bisect(error):
                    return read
                log.exception("engine step failed; handing the in-flight requests back, exiting")
                self.engine_failed = self.stopping = True
                self.engine_error = error
                return read
            requests.charge_step(time.perf_counter() - started)
            for out in outputs:
                requests.finished(out)
            stepped = True
        if self.sink.due(idle=not self.engine.has_unfinished() and read == 0):
            self.flush()
        elif not stepped and read == 0 and block is None:
            time.sleep(0.01)  # nothing ran and nothing blocked: do not spin
        return read

    # -- what the keeper thread learned -------------------------------------------

    def start_keeper(self) -> None:
        """Start the thread that keeps claims and heartbeat fresh and hears cancels (once)."""
        if self.keeper.ident is None:
            self._sync_keeper(beat=True)
            self.keeper.start()

    def _sync_keeper(self, beat: bool = False) -> None:
        """Hand the keeper what we hold (and the heartbeat when due); take what it heard."""
        if beat:
            self.keeper.held = self.requests.held()
        if beat or self.upkeep.due("heartbeat", self.config.heartbeat_s / 2):
            self.keeper.payload = self.upkeep.payload(self.activity())
        stolen = self.keeper.take_stolen()
        if stolen:
            self.requests.release(stolen)
        self.requests.cancel(self.keeper.cancelled)

    # -- the heartbeat ----------------------------------------------------------

    def activity(self) -> dict[str, Any]:
        """The loop's part of the heartbeat: requests held per job, live progress per job
        (progress.py), rows, counters, engine."""
        stats = self.engine.stats()
        engine = dataclasses.asdict(stats) if stats is not None else {}
        return {
            "in_flight": self.requests.per_job(),
            "progress": self.requests.live_progress(),
            "cancels": dict(self.requests.cancel_seen),
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
            self._redis_down(RuntimeError(f"commit failed: {flushed.redis_error}"))
            return False
        self._redis_ok()
        result = flushed.commit
        if result is None:
            return True
        self._count("commits")
        for job_id in result.finished:  # all its rows are in: the heartbeat names it no more
            self.requests.progress.forget(job_id)
        # the committed rows leave the heartbeat's pending tokens now, not a beat later
        # (status adds those to the job's committed counts: it would count them twice)
        self.keeper.beat_now(self.upkeep.payload(self.activity()))
        self.requests.cache.store(flushed.parts, self.requests.held)
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
            running = self.requests.take_job(job_id)
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
        items = self.requests.take_all(outputs, self.engine_failed, self.engine_error)
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
        self._count("redis_outages")  # the heartbeat says so once Redis takes it again
        delay = backoff_delay(self._redis_failures, 0.1, 5.0)
        self.redis_outage.down(f"Redis unavailable ({exc})")
        log.debug("Redis unavailable (%s); retrying in %.1fs", exc, delay)
        self._backoff_until = time.monotonic() + delay
        self._redis_failures += 1

    def _redis_ok(self) -> None:
        self._redis_failures = 0
        self.redis_outage.up()

    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            # Ctrl-C in a terminal hits the whole process group; under a supervisor
            # the SIGTERM it forwards is the one to act on (a second would be "now").
            sigint = signal.SIG_IGN if self.config.supervised else self.stop
            signal.signal(signal.SIGINT, sigint)
