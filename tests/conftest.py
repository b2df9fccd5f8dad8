"""Shared fixtures: a real private redis-server and toy checkpoints.

No Redis is ever mocked: tests talk to a redis-server process started here,
which they may kill -9 and restart on the same data dir.

``make pytest`` runs the tests in two pytest-xdist worker processes (``-n 2
--dist loadfile``: a module's tests, and so its module-scoped fixtures, stay
on one worker). What two tests running at once could share is kept apart:
each worker has its own session Redis and its own ``BATCHGEN_HOME`` (so the
embedded Redis, fingerprint memos and result cache are never the user's or
the other worker's); ports come from the kernel (``free_port``). Toy
checkpoints are built once per run and read by both workers.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from batchgen.jobs.redis.redis_server import RedisServer

# Every redis-server a test starts dies with the pytest process that started it,
# however that ends (Ctrl-C, SIGTERM, SIGKILL): none is left running after `make test`.
RedisServer.dies_with_parent = True

# Without CUDA the Triton kernels run on the CPU through the interpreter;
# triton.jit reads this when a kernel is defined, so it must precede every
# import of batchgen.kernels.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist each worker takes its share of the cores: torch's default (a
# thread per core) in each of two workers oversubscribes them, and OpenMP threads
# then spin against each other. Processes the tests start inherit the same share.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS > 1:
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _XDIST_WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Modules that hold a slow test first, in their order, then the rest: a parallel run
    # (make pytest: a module at a time, in this order) starts the long ones early and
    # ends on short ones instead of one worker finishing the soak alone.
    slow = {item.nodeid.split("::")[0] for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def shared_dir(factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this run sees (the run's base temp dir); the
    session's own base temp dir when not under xdist."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """``<shared_dir>/name``, made by ``build(folder)`` in the first worker that asks;
    a worker asking meanwhile waits on the lock, then reads the finished folder. For
    what is costly and never modified by the tests that read it."""
    shared = shared_dir(factory)
    final = shared / name
    with _flock(shared / f"{name}.lock", fcntl.LOCK_EX):
        if not final.is_dir():
            partial = shared / f"{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            build(partial)
            partial.rename(final)
    return final


@pytest.fixture(scope="session", autouse=True)
def batchgen_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``BATCHGEN_HOME`` of this worker's session, inherited by every process a test
    starts: nothing writes to the user's data dir or shares the other worker's. A
    test that needs a home of its own still sets one."""
    from batchgen.jobs.redis import embedded

    home = tmp_path_factory.mktemp("batchgen-home")
    saved = os.environ.get("BATCHGEN_HOME")
    os.environ["BATCHGEN_HOME"] = str(home)
    yield home
    if embedded.redis_dir(home).is_dir():
        embedded.stop(home)  # one a test started through the default home
    if saved is None:
        os.environ.pop("BATCHGEN_HOME", None)
    else:
        os.environ["BATCHGEN_HOME"] = saved


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
    """A redis-server of this test's own, to kill and restart at will.

    It fsyncs its AOF before every reply (``appendfsync always``), so a write it
    acknowledged survives a SIGKILL and the tests can count on it. With the
    product's ``everysec``, Redis postpones a write for up to 2 s while an fsync
    is slow and still replies: a kill then loses acknowledged writes, its
    documented window (CI's disk once lost 37 of 1,000 XADDs this way), which
    docs/reliability.md states and no test here is about."""
    server = RedisServer(tmp_path / "redis", extra_args=("--appendfsync", "always"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``toy_model(arch, size="tiny", **kw)``: a toy checkpoint directory, built once per
    run and shared by the xdist workers (tests only read it; copy it to change it)."""
    from batchgen.toy import write_toy_checkpoint

    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", size: str = "tiny", **kwargs) -> Path:
        key = (arch, size, *sorted(kwargs.items()))
        if key not in cache:
            name = "-".join([arch, size, *(f"{k}{v}" for k, v in key[2:])])
            cache[key] = built_once(
                tmp_path_factory, f"toy-{name}",
                lambda out: write_toy_checkpoint(out, arch=arch, size=size, **kwargs),
            )  # fmt: skip
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
