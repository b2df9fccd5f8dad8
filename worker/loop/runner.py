"""The queue loop: keep the engine's in-flight set full from the stream, commit rows.

Each tick: upkeep (heartbeat, refresh, reclaim, cancel poll, sweep; each on its
own interval), read at most ``free_capacity()`` new entries (blocking on Redis
only when the engine is idle and nothing waits to be committed), admit them,
run one engine step, and flush the sink when due. Requests that cannot run
become error rows. On SIGTERM/SIGINT it stops admitting, commits finished
rows, hands unfinished requests back with their tokens so far, and exits
within ``drain_timeout_s``.

Isolation: some sets of requests run alone, nothing admitted beside them.
- An exception in an engine step (a bug, an out-of-memory) bisects the batch:
  the engine drops its requests, and the in-flight set runs again in two
  halves, one after the other, each halved again if it fails, so its
  batch-mates finish here, uncharged. When a step with one request fails, that
  request is the culprit: it goes back charged with a failed attempt and the
  error, everything else goes back uncharged, and the loop exits with
  ``ENGINE_FAILED_EXIT`` so that the supervisor starts a fresh engine (an error
  may have left this one broken). A culprit is dead-lettered once its failed
  attempts pass ``max_attempts``.
- A crash cannot be bisected (the process is gone; the next delivery counts it
  against every request that was running). A request on its last allowed
  attempt runs alone, so a poison request is dead-lettered by itself and its
  batch-mates are not. A worker holds one such suspect at a time: the others it
  reads are handed straight back, uncharged, so a crash while the one runs
  alone is charged to that one only.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import redis

from batchgen.jobs.keys import Keys
from batchgen.jobs.queue import Delivery, HandBack, hand_back, read_new
from batchgen.jobs.sink import PartSink
from batchgen.jobs.submit import ensure_group
from batchgen.jobs.tasks import enqueue_finalize
from batchgen.worker.loop.config import ENGINE_FAILED_EXIT, LoopConfig
from batchgen.worker.loop.engine_api import EngineAPI
from batchgen.worker.loop.flight import Flight, error_row, output_row
from batchgen.worker.loop.upkeep import Upkeep

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
        # sets of requests to run alone, in turn: bisection halves, last-chance suspects
        self.alone: list[list[Delivery]] = []
        self.alone_running: set[str] = set()  # entry ids of the set running alone now
        self.bisected: set[str] = set()  # entry ids that ran here before a failed step
        self.engine_failed = False
        self.engine_error = ""  # what the failed step raised, kept with the hand-backs
        self.sink = PartSink(
            self.qk,
            config.name,
            flush_rows=config.flush_rows,
            flush_interval_s=config.flush_interval_s,
        )
        self.upkeep = Upkeep(self)
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
        self.upkeep.run()
        read = 0
        block = None
        if self.alone and not self.inflight and not self.stopping:
            self._start_alone()
        capacity = 0 if (self.alone or self.alone_running) else self.engine.free_capacity()
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
            self.admit(deliveries)
        stepped = False
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
            if job is None or d.job_id in self.upkeep.cancelled:
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
        """Keep one suspect to run alone; hand the others back as they came.

        They did not run here, so neither their attempts nor their failures
        grow; the next worker to read one finds it still on its last chance.
        """
        if not self.alone and not self.alone_running:
            self.alone.append([suspects.pop(0)])
        if not suspects:
            return
        items = [HandBack(d, list(d.resume), ran=False) for d in suspects]
        try:
            self._count("deferred", hand_back(self.conn, self.qk, self.config.name, items))
        except _REDIS_DOWN as exc:  # keep them (refreshed) and run them alone, in turn
            log.warning("could not hand suspects back (%s); they wait here", exc)
            self.alone += [[d] for d in suspects]

    def _start_alone(self) -> None:
        for d in self.alone.pop(0):
            job = self.upkeep.job(d.job_id)
            if job is None or d.job_id in self.upkeep.cancelled:
                self.sink.drop([d.entry_id])
                continue
            self._start(d, job.output)
            if d.entry_id in self.inflight:
                self.alone_running.add(d.entry_id)

    def keep_alone(self, keep: Callable[[Delivery], bool]) -> list[list[Delivery]]:
        """The sets waiting to run alone, holding only the deliveries ``keep`` accepts."""
        return [g for g in ([d for d in group if keep(d)] for group in self.alone) if g]

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
            self.bisected.add(entry_id)
        self.inflight.clear()
        self.alone_running.clear()
        half = len(deliveries) // 2
        self.alone[:0] = [deliveries[:half], deliveries[half:]]
        log.warning(
            "engine step failed (%s); running its %d requests again in halves to find the culprit",
            error,
            len(deliveries),
        )
        self._count("bisections")
        return True

    def _start(self, d: Delivery, output: str) -> None:
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
        self.sink.add(d.job_id, output, d.entry_id, row)
        self._count("rows_error")

    def finished(self, out) -> None:
        self.alone_running.discard(out.request_id)
        self.bisected.discard(out.request_id)
        flight = self.inflight.pop(out.request_id, None)
        if flight is None:
            return  # aborted meanwhile (cancelled, or claimed by another worker)
        row = output_row(flight, out, self.config.name)
        self.sink.add(flight.delivery.job_id, flight.output, flight.delivery.entry_id, row)
        self._count("rows_error" if row.failed else "rows_ok")
        self._count("prompt_tokens", row.prompt_tokens)
        self._count("generation_tokens", row.completion_tokens)

    def abort(self, entry_id: str) -> None:
        self.alone_running.discard(entry_id)
        self.bisected.discard(entry_id)
        if self.inflight.pop(entry_id, None) is not None:
            self.engine.abort(entry_id)

    # -- Redis steps -----------------------------------------------------------

    def flush(self) -> bool:
        result = self.sink.flush(self.conn)
        if result is None:
            self._redis_down(RuntimeError("commit failed"))
            return False
        self._redis_ok()
        self._count("commits")
        self._count("rows_lost_to_duplicates", result.lost)
        for job_id in result.missing:
            log.error("job %s is gone from Redis (state lost?); dropped its rows", job_id)
        for job_id in result.finished:
            enqueue_finalize(self.conn, self.keys, job_id)
        self.finished_jobs = bool(result.finished)
        return True

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
        # a bisection half ran here (gracefully handed back); a suspect never started
        items += [
            HandBack(d, list(d.resume), ran=d.entry_id in self.bisected)
            for group in self.alone
            for d in group
        ]
        self.alone.clear()
        while items and time.monotonic() < deadline:
            try:
                self._count("handed_back", hand_back(self.conn, self.qk, self.config.name, items))
                break
            except _REDIS_DOWN as exc:
                log.warning("hand-back failed (%s); retrying until the drain timeout", exc)
                time.sleep(0.2)
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
