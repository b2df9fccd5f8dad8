"""The worker supervisor's pieces: GPU specs, child plans, metrics; the CLI stays light."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from batchgen.jobs.redis import heartbeat
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import free_port
from batchgen.jobs.redis.stream import ensure_group
from batchgen.jobs.schema.errors import UsageError
from batchgen.worker import cpu_threads
from batchgen.worker.loop.loop_config import ENGINE_FAILED_EXIT, LoopConfig
from batchgen.worker.loop.metrics import registry, serve
from batchgen.worker.loop.supervisor import (
    MAX_FAST_FAILURES,
    RESTART_DELAY_S,
    Child,
    Supervisor,
    parse_gpus,
    plan_children,
)


def test_gpu_specs():
    assert parse_gpus("all", 4) == [0, 1, 2, 3]
    assert parse_gpus("0-2,5", 8) == [0, 1, 2, 5]
    assert parse_gpus("3,1,1", 4) == [1, 3]
    with pytest.raises(UsageError, match="this machine has GPUs 0-1"):
        parse_gpus("0-3", 2)
    with pytest.raises(UsageError, match="use 'all', a range like 0-7"):
        parse_gpus("x", 2)
    with pytest.raises(UsageError, match="no CUDA device is visible"):
        parse_gpus("0", 0)


def test_cpu_workers_share_the_cpus_they_may_use_and_wait_without_spinning(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_threads, "CGROUP_ROOT", tmp_path)  # no quota: test_cpu_threads.py
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 64)  # the host's cores: not this process's
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    plan = plan_children(None, "cpu", 4)
    env = {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"}
    assert plan == [{"env": env, "device": "cpu"}] * 4
    assert plan_children(None, "cpu", 4, threads=3)[0]["env"]["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # the user's choice stands
    assert plan_children(None, "cpu", 2)[0]["env"] == {"OMP_NUM_THREADS": "4"}
    with pytest.raises(UsageError, match="--workers must be at least 1"):
        plan_children(None, "cpu", -1)


def test_metrics_endpoint_renders_its_workers_and_the_queue(redis_url):
    conn: Any = redis.Redis.from_url(redis_url)
    keys = Keys("bg")
    sup = Supervisor(conn, LoopConfig(model="m"), [], None)
    ensure_group(conn, keys.queue_for_model("m"))
    conn.xadd(keys.queue_for_model("m").stream, {"j": "x", "i": 0, "r": "{}", "q": 1})
    payload = {"name": "w1", "tag": keys.queue_for_model("m").tag, "supervisor": sup.id,
               "in_flight": {"j": 3}, "buffered_rows": 2,
               "counters": {"rows_ok": 7, "rows_error": 1, "generation_tokens": 99},
               "engine": {"kv_usage": 0.25, "num_running": 3}}  # fmt: skip
    heartbeat.beat(conn, keys, "w1", payload, 30)
    heartbeat.beat(conn, keys, "other", {**payload, "name": "other", "supervisor": "x"}, 30)
    port = free_port()
    server = serve(port, registry(sup.metrics))
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    finally:
        server.shutdown()
        server.server_close()
    parsed = list(text_string_to_metric_families(body))
    samples = [(s.name, s.labels, s.value) for f in parsed for s in f.samples]
    for expected in [
        ("batchgen_requests_total", {"worker": "w1", "status": "ok"}, 7),
        ("batchgen_requests_total", {"worker": "w1", "status": "error"}, 1),
        ("batchgen_generation_tokens_total", {"worker": "w1"}, 99),
        ("batchgen_kv_usage", {"worker": "w1"}, 0.25),
        ("batchgen_in_flight", {"worker": "w1"}, 5),
        ("batchgen_queue_entries", {"model": "m"}, 1),
        ("batchgen_queue_lag", {"model": "m"}, 1),
    ]:
        assert expected in samples
    assert {f.name: f.type for f in parsed}["batchgen_requests"] == "counter"
    assert "other" not in body  # another supervisor's worker


def test_a_child_that_served_is_restarted_soon_and_never_given_up_on(redis_url):
    """A crash after the first heartbeat (kill -9, a poison request) is not a start
    failure: a job with a few poison requests must not make the supervisor quit."""
    conn: Any = redis.Redis.from_url(redis_url)
    sup = Supervisor(conn, LoopConfig(model="m"), [], None)
    child = Child(0, sup.base, {})
    sup.children = [child]

    def crash(served: bool, rc: int = 9) -> int:
        child.names.append(f"w-{len(child.names)}")
        if served:
            conn.zadd(Keys("bg").workers, {child.names[-1]: 1.0})
        child.process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({rc})"])
        child.process.wait()
        child.started = time.monotonic()  # it died right after start
        return sup._reap()

    for _ in range(MAX_FAST_FAILURES + 2):
        assert crash(served=True) == 0 and child.fast_failures == 0
        assert child.restart_at - child.started == pytest.approx(RESTART_DELAY_S, abs=1.0)
        # an engine that raised: handed back, retired its heartbeat, exited with this
        assert crash(served=False, rc=ENGINE_FAILED_EXIT) == 0 and child.fast_failures == 0
    for n in range(1, MAX_FAST_FAILURES):  # died before serving: backoff, then give up
        assert crash(served=False) == 0 and child.fast_failures == n
    assert crash(served=False) == 1


def test_a_killed_childs_heartbeat_is_retired_at_once(redis_url):
    """A child killed -9 never retires its heartbeat: the supervisor does, once it has
    read from it that the child served. Until then status counted the dead worker's
    requests and a deleted job stayed named in it for the heartbeat's TTL."""
    conn: Any = redis.Redis.from_url(redis_url)
    keys = Keys("bg")
    sup = Supervisor(conn, LoopConfig(model="m"), [], None)
    child = Child(0, sup.base, {})
    sup.children = [child]
    child.names.append("killed-w0")
    heartbeat.beat(conn, keys, "killed-w0", {"name": "killed-w0", "in_flight": {"gone": 3}}, 60)
    heartbeat.beat(conn, keys, "alive-w1", {"name": "alive-w1", "in_flight": {"gone": 2}}, 60)
    child.process = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    child.process.wait()
    child.started = time.monotonic() - 60
    assert sup._reap() == 0
    # it served (its heartbeat said so before it went): restarted soon, no backoff
    assert child.restart_at - time.monotonic() == pytest.approx(RESTART_DELAY_S, abs=1.0)
    assert conn.get(keys.worker("killed-w0")) is None
    assert conn.zscore(keys.workers, "killed-w0") is None
    assert [w["name"] for w in heartbeat.live_workers(conn, keys)] == ["alive-w1"]

    # killed while the supervisor itself stops (its last loop never reaped it): the same
    child.names.append("killed-w0-again")
    heartbeat.beat(conn, keys, "killed-w0-again", {"name": "killed-w0-again"}, 60)
    child.process = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    child.process.wait()
    sup._terminate()
    assert [w["name"] for w in heartbeat.live_workers(conn, keys)] == ["alive-w1"]


def test_status_and_submit_never_import_torch():
    code = (
        "import sys\n"
        "from batchgen.cli import main\n"
        "import batchgen.cli.status, batchgen.cli.submit, batchgen.cli.jobs, batchgen.cli.cancel, "
        "batchgen.cli.download\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('batchgen.worker')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
