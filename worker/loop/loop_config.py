"""Settings of one queue loop (one engine process)."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from batchgen.jobs.redis.keys import model_name, queue_name
from batchgen.worker.engine_config import EngineConfig

# The exit status of an engine process whose engine raised in a step (sysexits
# EX_SOFTWARE): it served, handed its requests back, and wants a fresh engine.
ENGINE_FAILED_EXIT = 70
# An engine process that could not load its model (sysexits EX_CONFIG): it said why on
# stderr in one line, and a fresh process would fail the same way, so none is started.
MODEL_REFUSED_EXIT = 78


def default_name() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host.lstrip('.-_') or 'host'}-{os.getpid()}-{secrets.token_hex(2)}"


@dataclass(slots=True)
class LoopConfig:
    model: str
    name: str = field(default_factory=default_name)  # the consumer name; unique per process
    redis_url: str | None = None
    prefix: str = "bg"
    burst: bool = False  # exit once the model's stream is empty and nothing is in flight
    max_attempts: int = 3  # deliveries before an entry is dead-lettered
    claim_timeout_s: float = 60.0  # an entry idle this long belongs to a dead worker
    heartbeat_s: float = 5.0
    block_ms: int = 1000  # XREADGROUP BLOCK when the engine is idle
    flush_rows: int = 4096
    flush_interval_s: float = 2.0
    drain_timeout_s: float = 30.0  # SIGTERM: time to commit and hand back before exiting
    storage_outage_s: float = 300.0  # a job's parts unwritable this long: hand its requests back
    sweep_interval_s: float = 10.0
    deadline_check_s: float = (
        1.0  # how often deadlines are weighed (jobs/ops/fair_share/deadlines.py)
    )
    # take this worker's prefix groups first (affinity.py); False: every group in input
    # order, as a lone worker does (the baseline benchmarks/prefix_affinity_bench.py measures)
    prefix_affinity: bool = True
    cancel_poll_s: float = 1.0
    supervisor: str = ""  # the supervisor's id, for metrics
    supervised: bool = False  # SIGINT goes to the supervisor, which forwards SIGTERM
    engine: EngineConfig = field(default_factory=EngineConfig)
    queue: str = ""  # the queue's name when it is not the model's (batchgen run's own)

    def __post_init__(self) -> None:
        self.model = model_name(self.model)  # as heartbeats, metrics and logs show it

    @property
    def queue_name(self) -> str:
        return self.queue or queue_name(self.model)

    @property
    def refresh_s(self) -> float:
        return self.claim_timeout_s / 4

    @property
    def reclaim_s(self) -> float:
        return max(self.claim_timeout_s / 4, 0.05)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopConfig:
        return cls(**{**data, "engine": EngineConfig(**data.get("engine", {}))})
