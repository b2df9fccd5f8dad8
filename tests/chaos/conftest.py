"""Fixtures of the fault tests: a toy model, its fault-free reference, a Chaos world."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchgen.jobs.redis.redis_server import RedisServer
from tests.chaos.harness import Chaos
from tests.chaos.reference import Reference, fault_free


@pytest.fixture(scope="session")
def model(toy_model) -> Path:
    return toy_model("llama")


@pytest.fixture(scope="session")
def reference(model: Path) -> Iterator[Callable[[list[dict]], Reference]]:
    """Greedy outputs of ``Engine.generate`` on the same lines, with no fault at all."""
    from batchgen import Engine

    engine = Engine.from_pretrained(model, device="cpu")
    cache: dict[str, Reference] = {}

    def run(lines: list[dict]) -> Reference:
        key = json.dumps(lines, sort_keys=True)
        if key not in cache:
            cache[key] = fault_free(engine, model, lines)
        return cache[key]

    yield run


@pytest.fixture
def chaos(redis_url: str, model: Path, tmp_path: Path) -> Iterator[Chaos]:
    """On the session's shared Redis (flushed for this test)."""
    world = Chaos(redis_url, model, tmp_path)
    yield world
    world.stop_all()


@pytest.fixture
def chaos_private(private_redis: RedisServer, model: Path, tmp_path: Path) -> Iterator[Chaos]:
    """On a Redis of this test's own (``chaos_private.server``), to kill and restart."""
    world = Chaos(private_redis.url, model, tmp_path, server=private_redis)
    yield world
    world.stop_all()
