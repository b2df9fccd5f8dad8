"""Several hosts on one machine (network namespaces on a bridge, tests/netns.py):
Redis, the S3 store, three workers and the CLI each at an address of its own. One
worker host drops off the network mid-job for longer than the claim timeout; the
others take over its requests, its late commits count for nothing, and the result
holds exactly one row per line, tokens equal to the fault-free run."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import pytest

from tests.chaos.fleet import cut_one_worker, fleet
from tests.chaos.harness import assert_exactly_once, prompt_lines, wait_until
from tests.netns import Hosts, unavailable

pytestmark = pytest.mark.slow
WORKERS = ["w1", "w2", "w3"]


@pytest.fixture
def hosts_ok() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(f"the fleet-on-namespaces test {reason}")


def test_a_worker_host_cut_off_mid_job_is_taken_over_exactly_once(
    hosts_ok, model, reference, tmp_path
):
    lines = prompt_lines(24, "net", max_tokens=(32, 64))
    with fleet(tmp_path, model, WORKERS) as chaos:
        report = cut_one_worker(chaos, "net", lines, WORKERS, claim_timeout_s=2.0)
        assert report.held and report.cut_s > 2.0
        rows = chaos.result("net")
        assert_exactly_once(rows, lines, reference(lines))
        by_line = dict(zip(rows["index"], rows["worker"], strict=True))
        assert all(by_line[i] != "w1" for i in report.held)  # taken over, w1's came late
        assert set(rows["worker"]) <= set(WORKERS)
        assert chaos.listing("net") == ["batchgen-job.json", "manifest.json", "result.parquet"]
        assert chaos.pending() == 0 and chaos.conn.xlen(chaos.qk.stream) == 0
        assert all(proc.alive() for proc in chaos.procs)  # w1 came back and carried on
        beat = chaos.heartbeat("w1")
        assert beat is not None  # it reached Redis again after the cut
        late = beat["counters"]
        # what it held went to the others: released on its return, or its commit lost
        assert late.get("stolen", 0) + late.get("rows_lost_to_duplicates", 0) >= 1, late
        deleted = chaos.cli("delete", "net", "--outputs")  # from the client host too
        assert deleted.returncode == 0, deleted.stderr
        # nothing names the job but its tombstone (what status says of a deleted job)
        assert chaos.conn.keys("*net*") == [b"bg:deleted:net"]
        assert chaos.conn.hget("bg:jobs", "net") is None
        assert chaos.listing("net") == []


LISTEN = (
    "import socket,sys\ns=socket.create_server((sys.argv[1],7000))\nwhile 1: s.accept()[0].close()"
)
CONNECT = "import socket,sys\nsocket.create_connection((sys.argv[1],7000),timeout=1)"


def test_hosts_reach_each_other_only_while_linked_and_leave_nothing_behind(hosts_ok):
    """Host a connects to host b at the address the test assigned; a cut link drops
    the traffic; a failure inside the block still removes every namespace and link."""
    hosts = Hosts()
    server = None
    with pytest.raises(RuntimeError, match="the body failed"):
        try:
            hosts.start()
            a, b = hosts.add("a"), hosts.add("b")
            assert ipaddress.ip_address(a) in hosts.subnet and b != a
            server = subprocess.Popen([*hosts.exec("b"), sys.executable, "-c", LISTEN, b])
            connect = [*hosts.exec("a"), sys.executable, "-c", CONNECT, b]
            wait_until(lambda: subprocess.run(connect, capture_output=True).returncode == 0,
                       30, "a to reach b")  # fmt: skip
            hosts.cut("b")
            assert subprocess.run(connect, capture_output=True).returncode != 0
            hosts.mend("b")
            wait_until(lambda: subprocess.run(connect, capture_output=True).returncode == 0,
                       30, "a to reach b again")  # fmt: skip
            raise RuntimeError("the body failed")
        finally:
            if server is not None:
                server.kill()
                server.wait()
            assert hosts.close() == []
    assert hosts.leftovers() == []
