"""Shared fixtures: a real private redis-server and toy checkpoints.

No Redis is ever mocked: tests talk to a redis-server process started here,
which they may kill -9 and restart on the same data dir.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from batchgen.jobs.redis.redis_server import RedisServer

# Without CUDA the Triton kernels run on the CPU through the interpreter;
# triton.jit reads this when a kernel is defined, so it must precede every
# import of batchgen.kernels.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One private redis-server (AOF on) shared by the session's tests."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the shared server, flushed before each test."""
    if redis_server.process is None or redis_server.process.poll() is not None:
        redis_server.start()  # a test killed it; bring it back on the same dir
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, to kill and restart at will."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``toy_model(arch, size="tiny", **kw)``: a cached toy checkpoint directory."""
    from batchgen.toy import write_toy_checkpoint

    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", size: str = "tiny", **kwargs) -> Path:
        key = (arch, size, *sorted(kwargs.items()))
        if key not in cache:
            name = "-".join(str(part) for part in (arch, size, *kwargs.values()))
            out = tmp_path_factory.mktemp(f"toy-{name}")
            cache[key] = write_toy_checkpoint(out, arch=arch, size=size, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``zoo_model(name)``: the tiny checkpoint ``tests/model_zoo.py`` describes, built once."""
    from tests import model_zoo

    cache: dict[str, Path] = {}
    tokenizer: list[Path] = []

    def make(name: str) -> Path:
        if name not in cache:
            if not tokenizer:
                tokenizer.append(model_zoo.build_tokenizer(tmp_path_factory.mktemp("zoo-tok")))
            out = tmp_path_factory.mktemp(f"zoo-{name}")
            cache[name] = model_zoo.build(name, out, tokenizer[0])
        return cache[name]

    return make


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 API: moto's standalone server (``moto_server``) on a free port, with a
    bucket ``batchgen-test``; pyarrow's own S3 client reaches it. Yields ``host:port``.
    Credentials are the environment's (AWS_* variables, set here for the session)."""
    from tests.s3_server import MotoServer

    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                             "AWS_DEFAULT_REGION")}  # fmt: skip
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    import pyarrow.fs as pafs

    endpoint = server.endpoint
    pafs.S3FileSystem(
        endpoint_override=endpoint, scheme="http", allow_bucket_creation=True
    ).create_dir("batchgen-test")
    yield endpoint
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
