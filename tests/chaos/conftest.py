"""Fixtures of the fault tests: a toy model, its fault-free reference, a Chaos world."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from batchgen.jobs.redis.redis_server import RedisServer
from tests.chaos.harness import Chaos, Reference


@pytest.fixture(scope="session")
def model(toy_model) -> Path:
    return toy_model("llama")


@pytest.fixture(scope="session")
def reference(model: Path) -> Iterator[Callable[[list[dict]], Reference]]:
    """Greedy outputs of ``Engine.generate`` on the same lines, with no fault at all."""
    from batchgen.worker import Engine, SamplingParams

    engine = Engine.from_pretrained(model, device="cpu")
    cache: dict[str, Reference] = {}

    def run(lines: list[dict]) -> Reference:
        key = json.dumps(lines, sort_keys=True)
        if key not in cache:
            params = [SamplingParams(**{"max_tokens": 16, **sampling(line)}) for line in lines]
            with one_thread():
                outs = engine.generate([line["prompt"] for line in lines], params)
            prompts = [list(o.prompt_token_ids) for o in outs]
            token_ids = [list(o.token_ids) for o in outs]

            def through_tie(i: int, got: list[int]) -> tuple[list[int], str] | None:
                return _through_tie(engine, model, prompts[i], params[i], token_ids[i], got)

            cache[key] = Reference(token_ids, [o.text for o in outs], through_tie)
        return cache[key]

    yield run


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """As the workers run (OMP_NUM_THREADS=1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _through_tie(
    engine: Any, model: Path, prompt: list[int], params: Any, ref: list[int], got: list[int]
) -> tuple[list[int], str] | None:
    """Where ``got`` first leaves ``ref``, both tokens must be HF's top two with logits
    closer than TIE_MARGIN (the margin measured, not assumed); then the engine resumes
    the request from ``got``'s side of the tie, as a worker resumes handed-back rows,
    and what it makes is what the run must have made. None when it is no such tie."""
    from tests.hf_reference import first_divergence_is_tie

    if not any(a != b for a, b in zip(ref, got)):
        return None  # one stopped earlier: a length, not a tie
    if not (first_divergence_is_tie(model, prompt, ref, got)
            and first_divergence_is_tie(model, prompt, got, ref)):  # fmt: skip
        return None
    split = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b) + 1
    rid = f"through-tie-{len(prompt)}-{split}-{got[split - 1]}"
    with one_thread():
        engine.add_request(rid, prompt, params, resume_token_ids=got[:split])
        while True:
            for out in engine.step():
                if out.request_id == rid:
                    return list(out.token_ids), out.text


def sampling(line: dict) -> dict:
    """A native line's sampling fields (job defaults are greedy, max_tokens 16)."""
    return {k: v for k, v in line.items() if k not in ("id", "prompt", "metadata")}


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
