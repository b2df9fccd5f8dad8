"""The worker supervisor's pieces: GPU specs, child plans, metrics; the CLI stays light."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from batchgen.jobs.redis import heartbeat
from batchgen.jobs.redis.keys import GROUP, Keys
from batchgen.jobs.redis.redis_server import free_port
from batchgen.jobs.redis.stream import ensure_group
from batchgen.jobs.schema.errors import UsageError
from batchgen.worker import cpu_threads
from batchgen.worker.loop.loop_config import ENGINE_FAILED_EXIT, LoopConfig
from batchgen.worker.supervisor.metrics import registry, serve
from batchgen.worker.supervisor.supervisor import (
    MAX_FAST_FAILURES,
    RESTART_DELAY_S,
    Child,
    Supervisor,
    gpu_groups,
    parse_gpus,
    plan_children,
    visible_device,
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


def test_tensor_parallel_groups_are_consecutive_gpus_one_engine_each():
    """``--gpus 0-7 --tensor-parallel-size 4``: two engines, each seeing four GPUs."""
    eight = [visible_device(g, None) for g in parse_gpus("0-7", 8)]
    assert gpu_groups(eight, 4, "0-7") == ["0,1,2,3", "4,5,6,7"]
    assert gpu_groups(eight, 8, "0-7") == ["0,1,2,3,4,5,6,7"]
    assert gpu_groups(eight, 1, "0-7") == eight  # one engine per GPU, as without the flag
    under_slurm = [visible_device(g, "4,5,6,7") for g in parse_gpus("all", 4)]
    assert gpu_groups(under_slurm, 2, "all") == ["4,5", "6,7"]
    with pytest.raises(UsageError) as raised:
        gpu_groups(eight, 3, "0-7")
    assert str(raised.value) == "--tensor-parallel-size 3 must divide the 8 GPU(s) of --gpus 0-7"


def test_cpu_ranks_share_the_cpus_with_the_other_workers(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("batchgen.worker.supervisor.supervisor.usable_cpus", lambda: 8)
    plan = plan_children(None, "cpu", 2, None, tensor_parallel_size=2)
    assert [child["env"]["OMP_NUM_THREADS"] for child in plan] == ["2", "2"]  # 2 x 2 ranks


def test_gpu_indices_count_within_the_parents_visible_devices():
    """``--gpus 0`` under a parent ``CUDA_VISIBLE_DEVICES=4,5`` (Slurm, a container) is
    device 4, the parent's first, not physical device 0."""
    assert [visible_device(g, None) for g in (0, 3)] == ["0", "3"]
    assert [visible_device(g, "4,5") for g in (0, 1)] == ["4", "5"]
    assert visible_device(1, " 4, 5 ") == "5"
    assert visible_device(0, "GPU-8d2c1b7e,GPU-0a9f") == "GPU-8d2c1b7e"
    message = "--gpus 2: CUDA_VISIBLE_DEVICES='4,5' lists 2 device(s); --gpus counts within that list, from 0"
    with pytest.raises(UsageError) as raised:
        visible_device(2, "4,5")
    assert str(raised.value) == message
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES='' lists 0 device"):
        visible_device(0, "")


def test_each_gpu_child_gets_its_entry_of_the_parents_visible_devices(monkeypatch):
    import torch  # no GPU here: torch is told it sees the parent's two devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert plan_children("0", None, None) == [
        {"env": {"CUDA_VISIBLE_DEVICES": "4"}, "device": "cuda"}
    ]
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in plan_children("all", None, None)] == [
        "4",
        "5",
    ]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in plan_children("1", None, None)] == ["1"]


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


@contextlib.contextmanager
def metrics_server(sup: Supervisor) -> Iterator[str]:
    """The supervisor's metrics served as ``worker --metrics-port`` serves them: its URL."""
    port = free_port()
    server = serve(port, registry(sup.metrics))
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def scrape(url: str) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    """family -> (type, samples), parsed by prometheus_client's own parser."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(body)
    }


def test_metrics_endpoint_serves_its_workers_the_queue_and_the_tenants_with_their_types(redis_url):
    conn: Any = redis.Redis.from_url(redis_url)
    keys = Keys("bg")
    qk = keys.queue_for_model("m")
    sup = Supervisor(conn, LoopConfig(model="m"), [], None, tenant_metrics=True)
    ensure_group(conn, qk)
    conn.xadd(qk.stream, {"j": "x", "i": 0, "r": "{}", "q": 1})
    conn.xadd(qk.stream, {"j": "x", "i": 1, "r": "{}", "q": 1})
    conn.xreadgroup(GROUP, "w1", {qk.stream: ">"}, count=1)  # one delivered: pending
    conn.hset(qk.usage, mapping={"t1|requests": 12, "t1|input_tokens": 300, "t1|cached_tokens": 40,
                                 "t1|output_tokens": 96, "t1|engine_us": 2_500_000})  # fmt: skip
    payload = {"name": "w1", "tag": qk.tag, "supervisor": sup.id,
               "in_flight": {"j": 3}, "buffered_rows": 2,
               "counters": {"rows_ok": 7, "rows_error": 1, "dead_lettered": 2, "handed_back": 3,
                            "reclaimed": 4, "lost_entries": 5, "prompt_tokens": 600,
                            "generation_tokens": 99, "reasoning_tokens": 31,
                            "cached_tokens": 40, "commits": 6,
                            "storage_failures": 8, "redis_outages": 9,
                            "engine_us": 1_500_000},
               "engine": {"kv_usage": 0.25, "num_running": 3, "num_waiting": 2,
                          "num_preemptions": 4, "prefix_cache_hit_rate": 0.5}}  # fmt: skip
    heartbeat.beat(conn, keys, "w1", payload, 30)
    heartbeat.beat(conn, keys, "other", {**payload, "name": "other", "supervisor": "x"}, 30)
    with metrics_server(sup) as url:
        families = scrape(url)
    w1, m, t1 = {"worker": "w1"}, {"model": "m"}, {"model": "m", "tenant": "t1"}

    def counter(name: str, value: float, labels: dict[str, str] = w1) -> tuple[str, list[Any]]:
        return "counter", [(f"{name}_total", labels, value)]

    assert families == {  # "other" is another supervisor's worker: not there
        "batchgen_requests": ("counter", [
            ("batchgen_requests_total", {**w1, "status": "ok"}, 7),
            ("batchgen_requests_total", {**w1, "status": "error"}, 1),
        ]),
        "batchgen_dead_lettered": counter("batchgen_dead_lettered", 2),
        "batchgen_handed_back": counter("batchgen_handed_back", 3),
        "batchgen_reclaimed": counter("batchgen_reclaimed", 4),
        "batchgen_lost_entries": counter("batchgen_lost_entries", 5),
        "batchgen_prompt_tokens": counter("batchgen_prompt_tokens", 600),
        "batchgen_generation_tokens": counter("batchgen_generation_tokens", 99),
        "batchgen_reasoning_tokens": counter("batchgen_reasoning_tokens", 31),
        "batchgen_cached_tokens": counter("batchgen_cached_tokens", 40),
        "batchgen_commits": counter("batchgen_commits", 6),
        "batchgen_storage_failures": counter("batchgen_storage_failures", 8),
        "batchgen_redis_outages": counter("batchgen_redis_outages", 9),
        "batchgen_engine_seconds": counter("batchgen_engine_seconds", 1.5),
        "batchgen_preemptions": counter("batchgen_preemptions", 4),
        "batchgen_kv_usage": ("gauge", [("batchgen_kv_usage", w1, 0.25)]),
        "batchgen_num_running": ("gauge", [("batchgen_num_running", w1, 3)]),
        "batchgen_num_waiting": ("gauge", [("batchgen_num_waiting", w1, 2)]),
        "batchgen_prefix_cache_hit_rate": ("gauge", [("batchgen_prefix_cache_hit_rate", w1, 0.5)]),
        "batchgen_in_flight": ("gauge", [("batchgen_in_flight", w1, 5)]),
        "batchgen_queue_entries": ("gauge", [("batchgen_queue_entries", m, 2)]),
        "batchgen_queue_pending": ("gauge", [("batchgen_queue_pending", m, 1)]),
        "batchgen_queue_lag": ("gauge", [("batchgen_queue_lag", m, 1)]),
        "batchgen_queue_backlog": ("gauge", [("batchgen_queue_backlog", m, 0)]),
        "batchgen_tenant_requests": counter("batchgen_tenant_requests", 12, t1),
        "batchgen_tenant_input_tokens": counter("batchgen_tenant_input_tokens", 300, t1),
        "batchgen_tenant_cached_tokens": counter("batchgen_tenant_cached_tokens", 40, t1),
        "batchgen_tenant_output_tokens": counter("batchgen_tenant_output_tokens", 96, t1),
        "batchgen_tenant_engine_seconds": counter("batchgen_tenant_engine_seconds", 2.5, t1),
    }  # fmt: skip


def test_label_values_with_quotes_backslashes_and_newlines_come_back_exactly(redis_url):
    """A model path, a tenant and a worker name may hold any character: each
    scraped label value is the string itself (the exposition escapes them)."""
    conn: Any = redis.Redis.from_url(redis_url)
    keys = Keys("bg")
    model, tenant, worker = '/models/my "best"\\ckpt\nv2', 'team "a"\\b\nc', 'host"1\\\n-w0'
    qk = keys.queue_for_model(model)
    sup = Supervisor(conn, LoopConfig(model=model), [], None, tenant_metrics=True)
    ensure_group(conn, qk)
    conn.xadd(qk.stream, {"j": "x", "i": 0, "r": "{}", "q": 1})
    conn.hset(qk.usage, f"{tenant}|requests", 3)
    heartbeat.beat(conn, keys, worker, {"name": worker, "tag": qk.tag, "supervisor": sup.id,
                                        "counters": {"rows_ok": 7}}, 30)  # fmt: skip
    with metrics_server(sup) as url:
        families = scrape(url)
    assert families["batchgen_requests"][1][0] == (
        "batchgen_requests_total",
        {"worker": worker, "status": "ok"},
        7,
    )
    assert families["batchgen_queue_entries"][1] == [
        ("batchgen_queue_entries", {"model": model}, 1)
    ]
    assert families["batchgen_tenant_requests"][1] == [
        ("batchgen_tenant_requests_total", {"model": model, "tenant": tenant}, 3)
    ]


def test_a_scrape_while_redis_is_unreachable_answers_503_in_one_line_and_the_next_is_served(
    redis_url,
):
    dead: Any = redis.Redis(port=free_port(), socket_connect_timeout=1)
    sup = Supervisor(dead, LoopConfig(model="m"), [], None)
    with metrics_server(sup) as url:
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(url, timeout=10)
        assert failed.value.code == 503
        body = failed.value.read().decode()
        assert body.startswith("# metrics unavailable: Error ") and body.count("\n") == 1
        sup.conn = redis.Redis.from_url(redis_url)  # Redis is back
        assert scrape(url)["batchgen_queue_entries"] == (
            "gauge",
            [("batchgen_queue_entries", {"model": "m"}, 0)],
        )


def test_a_metrics_port_another_process_holds_is_one_line():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(UsageError) as refused:
            serve(port, registry(lambda: []))
    assert str(refused.value) == (
        f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def _outward_address() -> str | None:
    """An address of this host that is not loopback (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_the_metrics_port_listens_on_loopback_only_unless_told_and_names_no_tenant(redis_url):
    """The endpoint has no authentication: by default it is reachable from this host
    only, and it lists no tenant (each would be named, with its usage) unless asked."""
    conn: Any = redis.Redis.from_url(redis_url)
    qk = Keys("bg").queue_for_model("m")
    ensure_group(conn, qk)
    conn.hset(qk.usage, "team-a|requests", 3)
    sup = Supervisor(conn, LoopConfig(model="m"), [], None)
    port = free_port()
    server = serve(port, registry(sup.metrics))
    try:
        assert server.server_address == ("127.0.0.1", port)
        outward = _outward_address()
        if outward is not None:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((outward, port), timeout=5).close()
        families = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    assert "batchgen_queue_entries" in families
    assert [name for name in families if "tenant" in name] == []
    asked = Supervisor(conn, LoopConfig(model="m"), [], None, tenant_metrics=True)
    tenants = {f.name: [(s.labels, s.value) for s in f.samples] for f in asked.metrics()}
    assert tenants["batchgen_tenant_requests"] == [({"model": "m", "tenant": "team-a"}, 3)]
    anywhere = serve(port, registry(lambda: []), "0.0.0.0")
    try:
        assert anywhere.server_address == ("0.0.0.0", port)
    finally:
        anywhere.shutdown()
        anywhere.server_close()


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
