"""A job whose input and output live on S3 (moto's server, pyarrow's own S3 client),
the endpoint given only by the standard ``AWS_ENDPOINT_URL``, credentials only by
AWS_* variables: two workers write parts there, finalize streams the result there,
``download`` (and ``--partial``) fetch it, and the store going away for 20 s
mid-job (refusing connections, or hung) loses nothing and charges nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tests.chaos.harness import Chaos, assert_exactly_once, prompt_lines, wait_until
from tests.s3_server import Gate, MotoServer

BUCKET = "fleet"
pytestmark = pytest.mark.slow


@dataclass
class Store:
    """moto behind a Gate; ``down`` takes it away as ``fault`` says: "refused" (its
    address refuses connections) or "hung" (SIGSTOP: connections open, no answer)."""

    server: MotoServer
    gate: Gate
    down_at: float = 0.0

    @property
    def endpoint(self) -> str:
        return self.gate.endpoint

    def down(self, fault: str) -> None:
        self.down_at = time.monotonic()
        self.gate.close() if fault == "refused" else self.server.pause()

    def up(self, fault: str) -> None:
        self.gate.open() if fault == "refused" else self.server.resume()


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A moto server of this test's own, reached through AWS_ENDPOINT_URL only."""
    server = MotoServer(tmp_path / "moto.log")
    server.start()
    gate = Gate((server.host, server.port))
    gate.open()
    for name, value in {"AWS_ACCESS_KEY_ID": "fleet", "AWS_SECRET_ACCESS_KEY": "fleet",
                        "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_ENDPOINT_URL": f"http://{gate.endpoint}"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    s3(server.endpoint).create_dir(BUCKET)
    try:
        yield Store(server, gate)
    finally:
        gate.close()
        server.stop()


def s3(endpoint: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(endpoint_override=endpoint, scheme="http",
                             allow_bucket_creation=True)  # fmt: skip


@pytest.mark.parametrize("fault", ["refused", "hung"])
def test_input_and_output_on_s3_survive_the_store_going_away(
    chaos: Chaos, reference, store: Store, fault: str
):
    # paced (a step >= 30 ms, a row >= 0.7 s, the job >= 17 s on 2 slots): the store
    # goes away mid-job however fast the machine
    lines = prompt_lines(48, "s3", max_tokens=(24, 32))
    with s3(store.endpoint).open_output_stream(f"{BUCKET}/in/prompts.jsonl") as out:
        out.write("".join(json.dumps(line) + "\n" for line in lines).encode())
    output = f"s3://{BUCKET}/out/s3job"
    submitted = chaos.cli("submit", f"s3://{BUCKET}/in/prompts.jsonl", "--model",
                          str(chaos.model), "--job-id", "s3job", "--output", output)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    assert chaos.record("s3job").source == f"s3://{BUCKET}/in/prompts.jsonl"
    # the fault-free run first: made while the workers run, it let them past row 40
    ref = reference(lines)
    workers = [chaos.loop_worker(name, max_num_seqs=1, step_s=0.03) for name in ("w1", "w2")]
    wait_until(lambda: chaos.record("s3job").done >= 2, 120, "some committed rows")

    dest = chaos.tmp / "partial.parquet"
    partial = chaos.cli("download", "s3job", "--partial", "-o", str(dest))
    assert partial.returncode == 0, partial.stderr
    early = pq.read_table(dest).to_pydict()
    assert 2 <= len(early["index"]) < 48
    for i, ids in zip(early["index"], early["token_ids"], strict=True):
        assert ids == ref.token_ids[i] and early["id"][early["index"].index(i)] == f"s3{i}"

    store.down(fault)
    try:
        done_before = chaos.record("s3job").done
        assert done_before < 40  # mid-job: rows still to write
        beats = [chaos.heartbeat(w.name) or {} for w in workers]
        wait_until(lambda: any(
            (chaos.heartbeat(w.name) or {}).get("counters", {}).get("storage_failures", 0) > 0
            for w in workers), 90, "a worker to report the store unreachable")  # fmt: skip
        assert all(beats)
        # 20 s at least; a hung store's first failure surfaces later (the part's open and
        # the clean-up after it each wait out storage.S3_REQUEST_TIMEOUT_S and retries)
        time.sleep(max(0.0, 20 - (time.monotonic() - store.down_at)))
        assert chaos.record("s3job").done <= done_before + 2  # at most what was in hand
    finally:
        store.up(fault)
    wait_until(lambda: chaos.record("s3job").state.value != "running", 180, "the rest")
    assert chaos.finalized("s3job", timeout=120) == "completed"
    rows = chaos.result("s3job")
    assert_exactly_once(rows, lines, ref)
    assert rows["attempts"] == [1] * len(lines)  # the outage was charged to no request
    assert sorted(set(rows["worker"])) <= ["w1", "w2"]
    listed = s3(store.endpoint).get_file_info(
        pafs.FileSelector(f"{BUCKET}/out/s3job", recursive=True)
    )
    assert sorted(i.base_name for i in listed if i.type == pafs.FileType.File) == [
        "batchgen-job.json", "manifest.json", "result.parquet"
    ]  # fmt: skip
    assert chaos.pending() == 0 and chaos.conn.xlen(chaos.qk.stream) == 0
    assert all(w.alive() for w in workers)  # the same processes served throughout
