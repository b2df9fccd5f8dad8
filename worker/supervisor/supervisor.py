"""The worker supervisor: one engine process per GPU or tensor-parallel group of GPUs
(or N on CPU), kept alive.

It imports no torch itself (except to count GPUs for ``--gpus`` and for a
tensor-parallel ``--device cuda``). Children run ``python -m batchgen.worker.loop``; a child that crashes is restarted: after
``RESTART_DELAY_S`` if it had started serving (its first heartbeat: it was
killed, ran out of memory, or met a poison request, which ``max_attempts``
dead-letters; a tensor-parallel engine whose other rank died exits so, its
ranks with it), with growing backoff if it died before that, and given up on
after repeated failures right at start (a broken config); one that could not
load its model (``MODEL_REFUSED_EXIT``) makes it give up at once. One that
exits 0 in burst mode is done. The supervisor also starts a finalizer process
whenever its model's finalize queue holds tasks (finalizer.py: a long
finalize never blocks the supervisor) and serves Prometheus metrics. SIGTERM
or SIGINT is forwarded to the children, which hand their requests back and
exit within their drain timeout; stragglers are killed after it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from typing import Any

import redis
from prometheus_client.metrics_core import Metric

from batchgen.jobs.backoff import backoff_delay
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.finalize.finalize_tasks import finalize_queue
from batchgen.jobs.ops.usage import model_usage
from batchgen.jobs.redis import heartbeat
from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import GROUP, Keys, queue_name
from batchgen.jobs.redis.outage_probe import OutageLog
from batchgen.jobs.schema.errors import UsageError
from batchgen.openmp_waits import SPIN_ENV, WAIT_VARIABLES
from batchgen.parts import child_environ, module_command
from batchgen.worker.cpu_threads import usable_cpus
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.loop.loop_config import (
    ENGINE_FAILED_EXIT,
    MODEL_REFUSED_EXIT,
    LoopConfig,
    default_name,
)
from batchgen.worker.supervisor.finalizer import Finalizers
from batchgen.worker.supervisor.metrics import families, registry, serve

log = logging.getLogger(__name__)
FAST_FAILURE_S = 20.0  # a child dying sooner than this after start failed to start
MAX_FAST_FAILURES = 5
RESTART_DELAY_S = 1.0  # a child that served, then crashed
ANNOUNCE_S = 5.0  # how often the supervisor says it runs its model's workers (TTL: 3x)


def parse_gpus(spec: str, available: int) -> list[int]:
    """``all``, ``0-7``, ``0,2,5`` or a mix (``0-3,6``) -> device indices."""
    if available <= 0:
        raise UsageError(
            "--gpus: no CUDA device is visible on this machine (torch.cuda.device_count() is 0); "
            "use --device cpu [--workers N]"
        )
    if spec.strip() == "all":
        return list(range(available))
    out: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UsageError(
            f"--gpus {spec!r}: use 'all', a range like 0-7, or a list like 0,2,5"
        ) from None
    bad = [g for g in out if not 0 <= g < available]
    if bad or not out:
        raise UsageError(f"--gpus {spec!r}: this machine has GPUs 0-{available - 1}")
    return sorted(set(out))


def visible_device(index: int, parent_visible: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of the child for ``--gpus`` index ``index``.

    ``--gpus`` counts the devices this process sees, as torch does: where the parent
    already has ``CUDA_VISIBLE_DEVICES`` (Slurm, a container), index ``i`` is the
    ``i``-th entry of that list (a number, ``GPU-<uuid>`` or ``MIG-<uuid>``), not
    physical device ``i``."""
    if parent_visible is None:
        return str(index)
    entries = [entry.strip() for entry in parent_visible.split(",") if entry.strip()]
    if not 0 <= index < len(entries):
        raise UsageError(
            f"--gpus {index}: CUDA_VISIBLE_DEVICES={parent_visible!r} lists "
            f"{len(entries)} device(s); --gpus counts within that list, from 0"
        )
    return entries[index]


@dataclass(slots=True)
class Child:
    index: int
    config: LoopConfig
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    fast_failures: int = 0
    restart_at: float = 0.0
    done: bool = False  # exited 0 (burst: drained)
    names: list[str] = field(default_factory=list)

    def start(self) -> None:
        config = replace(self.config, name=f"{default_name()}-w{self.index}")
        self.names.append(config.name)
        # The config (Redis password included) goes through a pipe: a command line
        # is readable by every local user (ps), the environment is inherited.
        self.process = subprocess.Popen(
            module_command("batchgen.worker.loop"), env=child_environ(self.env),
            stdin=subprocess.PIPE,
        )  # fmt: skip
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError), self.process.stdin as pipe:
            pipe.write(json.dumps(config.to_dict()).encode())  # far below a pipe's buffer
        self.started = time.monotonic()


class Supervisor:
    def __init__(
        self, conn: redis.Redis, base: LoopConfig, children_env: list[dict[str, str]],
        metrics_port: int | None = None, *, metrics_host: str = "127.0.0.1",
        tenant_metrics: bool = False,
    ) -> None:  # fmt: skip
        self.conn = conn
        self.keys = Keys(base.prefix)
        self.id = f"sup-{os.getpid()}-{secrets.token_hex(2)}"
        base = replace(base, supervisor=self.id, supervised=True)
        self.base = base
        self.children = [Child(i, base, env) for i, env in enumerate(children_env)]
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.tenant_metrics = tenant_metrics  # names every tenant: only where asked
        self.qk = self.keys.queue_for_model(base.model)
        self.finalizers = Finalizers(base.redis_url or "", base.prefix, self.qk.tag)
        self.stopping = False
        self.redis_outage = OutageLog(log, "worker supervisor")  # once as it starts and ends

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def metrics(self) -> list[Metric]:
        """The metric families of this supervisor's workers and its model's queue."""
        workers = [w for w in live_workers(self.conn, self.keys) if w.get("supervisor") == self.id]
        qk = self.keys.queue_for_model(self.base.model)
        entries = int(self.conn.xlen(qk.stream))
        try:
            pending = int(self.conn.xpending(qk.stream, GROUP)["pending"])
        except redis.ResponseError:
            pending = 0
        queue = {"entries": entries, "pending": pending, "backlog": backlog.total(self.conn, qk)}
        usage = {self.base.model: model_usage(self.conn, qk)} if self.tenant_metrics else None
        return families(workers, {self.base.model: queue}, usage)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        server = (
            serve(self.metrics_port, registry(self.metrics), self.metrics_host)
            if self.metrics_port
            else None
        )
        self._announce()  # before the engines load and hash the weights: a model is coming
        for child in self.children:
            child.start()
        next_finalize = next_announce = 0.0
        code = 0
        try:
            while not self.stopping:
                if time.monotonic() >= next_announce:
                    self._announce()
                    next_announce = time.monotonic() + ANNOUNCE_S
                code = self._reap()
                if code:
                    break
                drained = self.base.burst and all(c.done for c in self.children)
                if drained or time.monotonic() >= next_finalize:
                    queued = self._finalize()
                    next_finalize = time.monotonic() + 2.0
                    if drained and not queued and not self.finalizers.running():
                        break
                time.sleep(0.2)
        finally:
            self.finalizers.stop(timeout=5.0)
            self._terminate()
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                heartbeat.withdraw(self.conn, self.keys, self.id)
            if server is not None:
                server.shutdown()
                server.server_close()
        return code

    def _reap(self) -> int:
        now = time.monotonic()
        for child in self.children:
            proc = child.process
            if child.done:
                continue
            if proc is None:
                if now >= child.restart_at:
                    child.start()
                continue
            rc = proc.poll()
            if rc is None:
                continue
            child.process = None
            if rc == 0:
                child.done = True
                continue
            if rc == MODEL_REFUSED_EXIT:  # it said why; every restart would fail alike
                return 2
            lived = now - child.started
            served = rc == ENGINE_FAILED_EXIT or self._served(child)
            self._retire(child)  # it cannot beat again: gone from status now, not at its TTL
            if served:  # it served: go on
                child.fast_failures = 0
                delay = RESTART_DELAY_S
            else:
                child.fast_failures = child.fast_failures + 1 if lived < FAST_FAILURE_S else 0
                if child.fast_failures >= MAX_FAST_FAILURES:
                    log.error("worker %d failed %d times right after start; giving up",
                              child.index, child.fast_failures)  # fmt: skip
                    return 1
                delay = backoff_delay(child.fast_failures, 1.0, 30.0)
            log.warning("worker %d exited with %s after %.0fs; restarting in %.0fs",
                        child.index, rc, lived, delay)  # fmt: skip
            child.restart_at = now + delay
        return 0

    def _announce(self) -> None:
        """Say (for ``batchgen serve``) that this model's workers run or are starting."""
        try:
            heartbeat.announce(self.conn, self.keys, self.id, queue_name(self.base.model),
                               int(ANNOUNCE_S * 3))  # fmt: skip
            self.redis_outage.up()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.redis_outage.down(f"Redis unavailable ({exc}): the workers are not announced")

    def _served(self, child: Child) -> bool:
        """Whether the child's last process got as far as its first heartbeat (a
        child that exits gracefully retires its heartbeat: see ENGINE_FAILED_EXIT)."""
        try:
            return self.conn.zscore(self.keys.workers, child.names[-1]) is not None
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def _retire(self, child: Child) -> None:
        """The heartbeat of a child that died without retiring it (killed, crashed):
        it names the jobs it held, which status would count and delete would leave."""
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
            heartbeat.retire(self.conn, self.keys, child.names[-1])

    def _finalize(self) -> bool:
        """Start a finalizer if finalize tasks wait for one (Finalizers); whether tasks wait."""
        try:
            queued = finalize_queue(self.conn, self.keys, self.qk.tag).count > 0
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self.redis_outage.down(f"Redis unavailable ({exc}): the finalize queue is unread")
            return False
        self.redis_outage.up()
        self.finalizers.serve(queued)
        return queued

    def _terminate(self) -> None:
        live = [(c, c.process) for c in self.children if c.process is not None]
        for _, proc in live:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.base.drain_timeout_s + 10
        for child, proc in live:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not exit in time; killing it", proc.pid)
                proc.kill()
                proc.wait()
            if proc.returncode != 0:  # killed or crashed: it retired nothing
                self._retire(child)


def gpu_groups(devices: list[str], tensor_parallel_size: int, spec: str) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each engine process: ``devices`` (each GPU's entry)
    in consecutive groups of ``tensor_parallel_size``, one group per engine."""
    if len(devices) % tensor_parallel_size:
        raise UsageError(
            f"--tensor-parallel-size {tensor_parallel_size} must divide the "
            f"{len(devices)} GPU(s) of --gpus {spec}"
        )
    return [
        ",".join(devices[start : start + tensor_parallel_size])
        for start in range(0, len(devices), tensor_parallel_size)
    ]


def plan_children(
    gpus: str | None, device: str | None, workers: int | None, threads: int | None = None,
    tensor_parallel_size: int = 1,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per child: its env overrides and device. A CPU child's OpenMP gets its
    thread count (``threads``, else the usable CPUs shared among the children
    and their tensor-parallel ranks, unless OMP_NUM_THREADS is set) and a short
    spin before its threads sleep (``SPIN_ENV``), both before its torch loads
    (``batchgen/openmp_waits.py``). With ``--gpus``, each child is one
    tensor-parallel group and sees its ``tensor_parallel_size`` GPUs."""
    if gpus is not None:
        if workers is not None:
            raise UsageError("--workers is for CPU workers; --gpus starts one worker per GPU")
        if device not in (None, "cuda"):
            raise UsageError(f"--gpus runs on CUDA; it cannot be combined with --device {device}")
        import torch

        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [visible_device(g, parent_visible) for g in parse_gpus(gpus, available)]
        return [
            {"env": {"CUDA_VISIBLE_DEVICES": group}, "device": "cuda"}
            for group in gpu_groups(devices, tensor_parallel_size, gpus)
        ]
    n = workers or 1
    if n < 1:
        raise UsageError("--workers must be at least 1")
    if tensor_parallel_size > 1 and device is not None and device.startswith("cuda"):
        import torch  # each child's group needs its GPUs: refused before any child starts

        config = EngineConfig(device=device, tensor_parallel_size=tensor_parallel_size)
        config.check_visible_gpus(torch.cuda.device_count())
    env: dict[str, str] = {}
    if (device or "cpu") == "cpu":
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        elif "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // (n * tensor_parallel_size)))
        if not any(name in os.environ for name in WAIT_VARIABLES):
            env.update(SPIN_ENV)
    return [{"env": dict(env), "device": device} for _ in range(n)]
