"""The result cache across jobs (submit --cache): real redis-server, the real engine on a
toy checkpoint in an in-process queue loop, real Parquet cache files."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.ops.finalize.result import PartRecord, read_window
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.modelinfo import fingerprint
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema import tools
from batchgen.jobs.schema.errors import UsageError
from batchgen.jobs.schema.rows import SCHEMA, FinishReason, Row, to_table
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.jobs.schema.tool_parsers import Call
from batchgen.jobs.storage import result_cache
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.jobs.storage.result_cache import ResultCache, content_key, location
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.loop import LoopConfig, QueueLoop
from batchgen.worker.loop.engine_api import EngineAPI, load_engine

KEYS = Keys("bg")
ENGINE = EngineConfig(device="cpu", max_num_seqs=16, num_kv_blocks=256)
OLD = [f"The cache keeps row {i} of the first job" for i in range(8)]
NEW = [f"A prompt the first job never saw, number {i}" for i in range(4)]


@pytest.fixture(autouse=True)
def _restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture(scope="module")
def model(toy_model) -> Path:
    return toy_model("llama")


@pytest.fixture(scope="module")
def engines(model) -> dict[Path, EngineAPI]:
    return {model: load_engine(str(model), ENGINE)}


def engine_for(engines: dict[Path, EngineAPI], model: Path) -> EngineAPI:
    if model not in engines:
        engines[model] = load_engine(str(model), ENGINE)
    return engines[model]


@pytest.fixture
def conn(redis_url: str) -> Any:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def run_job(
    conn, engines, model: Path, tmp_path: Path, prompts: list[Any], job_id: str,
    cache: str, *, reasoning_parser: str | None = None, **defaults: Any,
) -> tuple[dict[str, list], dict[str, int]]:  # fmt: skip
    """Submit ``prompts`` as ``job_id``, run it on a fresh loop; (result columns, counters)."""
    src = tmp_path / f"{job_id}.jsonl"
    lines = [p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / f"out-{job_id}"
    submit(conn, KEYS, source_path=str(src), model=str(model), output=str(out),
           defaults={**DEFAULTS, "max_tokens": 6, **defaults}, job_id=job_id, cache=cache,
           reasoning_parser=reasoning_parser)  # fmt: skip
    config = LoopConfig(model=str(model), name=f"w-{job_id}", block_ms=50, flush_interval_s=0.05,
                        heartbeat_s=0.2, sweep_interval_s=0.2, engine=ENGINE)  # fmt: skip
    loop = QueueLoop(conn, engine_for(engines, model), config)
    deadline = time.monotonic() + 120

    def done() -> bool:
        assert time.monotonic() < deadline, "the loop did not finish the job in time"
        return load_job(conn, KEYS, job_id).state not in (JobState.QUEUED, JobState.RUNNING)

    loop.run(until=done)
    tasks.run_pending(conn, KEYS, loop.qk.tag)
    assert load_job(conn, KEYS, job_id).state == JobState.COMPLETED
    return pq.read_table(out / "result.parquet").to_pydict(), loop.counters


def by_prompt(result: dict[str, list], prompts: list[str]) -> dict[str, dict[str, Any]]:
    rows = [dict(zip(result, values)) for values in zip(*result.values())]
    return {prompts[row["index"]]: row for row in rows}


GENERATED = ("text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens")


def cache_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.parquet"))


def test_a_second_job_generates_only_its_new_prompts(conn, engines, model, tmp_path, cache_dir):
    first, counters = run_job(conn, engines, model, tmp_path, OLD, "A", str(cache_dir))
    assert counters["rows_ok"] == 8 and counters.get("rows_cached", 0) == 0
    assert counters["cache_stored"] == 8 and first["cached"] == [False] * 8
    assert first["cache_source"] == [None] * 8
    assert all(len(t) > 0 for t in first["token_ids"])

    prompts = OLD[:4] + NEW
    second, counters = run_job(conn, engines, model, tmp_path, prompts, "B", str(cache_dir))
    # the engine ran only the 4 new prompts: rows_ok counts the rows the engine finished
    assert counters["rows_ok"] == 4 and counters["rows_cached"] == 4
    assert second["cached"] == [True] * 4 + [False] * 4
    assert second["cache_source"] == ["A"] * 4 + [None] * 4
    a, b = by_prompt(first, OLD), by_prompt(second, prompts)
    for prompt in OLD[:4]:
        assert {k: b[prompt][k] for k in GENERATED} == {k: a[prompt][k] for k in GENERATED}
    job = load_job(conn, KEYS, "B")
    assert job.cache == str(cache_dir) and job.done == 8
    assert job.completion_tokens == sum(second["completion_tokens"])
    stats = ResultCache(conn, KEYS, str(cache_dir)).stats()
    assert (stats.entries, stats.hits, stats.misses) == (12, 4, 12)
    # a file per commit that stored rows: at least one per job, as many as the folder holds
    assert stats.files == len(cache_files(cache_dir)) >= 2
    assert stats.bytes == sum(p.stat().st_size for p in cache_files(cache_dir))


def test_other_sampling_never_hits_and_unseeded_sampling_is_not_cached(
    conn, engines, model, tmp_path, cache_dir
):
    uri, few = str(cache_dir), OLD[:3]
    run_job(conn, engines, model, tmp_path, few, "greedy", uri)
    _, counters = run_job(conn, engines, model, tmp_path, few, "longer", uri, max_tokens=5)
    assert counters.get("rows_cached", 0) == 0 and counters["rows_ok"] == 3
    seeded: dict[str, Any] = {"temperature": 0.9, "seed": 7}
    run_job(conn, engines, model, tmp_path, few, "seed7", uri, **seeded)
    again, counters = run_job(conn, engines, model, tmp_path, few, "seed7b", uri, **seeded)
    assert counters["rows_cached"] == 3 and again["cache_source"] == ["seed7"] * 3
    _, counters = run_job(conn, engines, model, tmp_path, few, "seed8", uri,
                          temperature=0.9, seed=8)  # fmt: skip
    assert counters.get("rows_cached", 0) == 0 and counters["rows_ok"] == 3
    entries = ResultCache(conn, KEYS, uri).stats().entries
    for job in ("free1", "free2"):  # sampling without a seed: neither served nor stored
        result, counters = run_job(conn, engines, model, tmp_path, few, job, uri, temperature=0.9)
        assert counters.get("rows_cached", 0) == 0 and counters.get("cache_stored", 0) == 0
        assert result["cached"] == [False] * 3
    assert ResultCache(conn, KEYS, uri).stats().entries == entries == 12


def test_content_key_covers_the_model_the_engine_and_every_sampling_field():
    base = content_key("sha256:a", "cpu/auto/256", [1, 2, 3], {"max_tokens": 6})
    assert base is not None and len(base) == 64
    assert content_key("sha256:a", "cpu/auto/256", [1, 2, 3], {"max_tokens": 6}) == base
    # a field left out takes its default, as the engine does
    assert content_key("sha256:a", "cpu/auto/256", [1, 2, 3],
                       {"max_tokens": 6, "temperature": 0, "top_p": 1.0}) == base  # fmt: skip
    others = [
        content_key("sha256:b", "cpu/auto/256", [1, 2, 3], {"max_tokens": 6}),
        content_key("sha256:a", "cuda/auto/256", [1, 2, 3], {"max_tokens": 6}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 4], {"max_tokens": 6}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 3], {"max_tokens": 7}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 3], {"max_tokens": 6, "stop": ["x"]}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 3], {"max_tokens": 6, "logprobs": 2}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 3], {"max_tokens": 6, "n": 2}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 3],
                    {"max_tokens": 6, "logit_bias": {"5": 1.0}}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 3],
                    {"max_tokens": 6, "structured_output": {"choice": ["yes", "no"]}}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 3], {"max_tokens": 6},
                    {"reasoning": "qwen3"}),
        content_key("sha256:a", "cpu/auto/256", [1, 2, 3], {"max_tokens": 6},
                    {"tool_choice": '"auto"', "tool_parser": "hermes"}),
    ]  # fmt: skip
    assert None not in others and len({base, *others}) == len(others) + 1
    assert content_key("", "cpu/auto/256", [1], {}) is None  # no fingerprint: no cache
    assert content_key("sha256:a", "cpu/auto/256", [1], {"temperature": 0.5}) is None
    assert content_key("sha256:a", "cpu/auto/256", [1], {"temperature": 0.5, "seed": 1})


def test_reasoning_and_tool_rows_hit_only_rows_split_the_same_way(
    conn, engines, model, tmp_path, cache_dir
):
    uri, few = str(cache_dir), OLD[:3]
    thought, _ = run_job(conn, engines, model, tmp_path, few, "R1", uri, reasoning_parser="think")
    assert thought["text"] == [""] * 3 and all(thought["reasoning"])  # no end tag: reasoning
    plain, counters = run_job(conn, engines, model, tmp_path, few, "P", uri)  # another split
    assert counters.get("rows_cached", 0) == 0 and plain["reasoning"] == [None] * 3
    again, counters = run_job(
        conn, engines, model, tmp_path, few, "R2", uri, reasoning_parser="think"
    )
    assert counters["rows_cached"] == 3 and again["cache_source"] == ["R1"] * 3
    for column in ("text", "token_ids", "reasoning", "reasoning_tokens"):
        assert again[column] == thought[column]
    assert thought["reasoning_tokens"] == [len(t) for t in thought["token_ids"]]
    named = {"type": "function", "function": {"name": "get_time"}}
    tool = [{"messages": [{"role": "user", "content": p}], "max_tokens": 40, "tools": [
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": False}}}], "tool_choice": named}
        for p in few]  # fmt: skip
    first, _ = run_job(conn, engines, model, tmp_path, tool, "T1", uri)
    second, counters = run_job(conn, engines, model, tmp_path, tool, "T2", uri)
    assert counters["rows_cached"] == 3 and second["finish_reason"] == ["tool_calls"] * 3
    for i in range(3):
        a, b = first["tool_calls"][i], second["tool_calls"][i]
        assert [c["function"] for c in a] == [c["function"] for c in b]
        call = Call(b[0]["function"]["name"], b[0]["function"]["arguments"])
        assert b == [tools.call_record(call, "T2", second["index"][i], 0)] != a  # its own id


def test_another_model_with_the_same_config_never_hits(
    conn, engines, model, toy_model, tmp_path, cache_dir
):
    other = toy_model("llama", seed=1)
    assert (other / "config.json").read_bytes() == (model / "config.json").read_bytes()
    first, _ = run_job(conn, engines, model, tmp_path, OLD[:4], "A", str(cache_dir))
    second, counters = run_job(conn, engines, other, tmp_path, OLD[:4], "B", str(cache_dir))
    assert counters.get("rows_cached", 0) == 0 and counters["rows_ok"] == 4
    assert second["cached"] == [False] * 4
    assert second["token_ids"] != first["token_ids"]  # other weights, other tokens
    assert fingerprint(str(other)) != fingerprint(str(model))


def test_a_deleted_or_damaged_cache_file_is_regenerated(conn, engines, model, tmp_path, cache_dir):
    uri, few = str(cache_dir), OLD[:4]
    first, _ = run_job(conn, engines, model, tmp_path, few, "A", uri)
    (deleted,) = cache_files(cache_dir)
    deleted.unlink()
    second, counters = run_job(conn, engines, model, tmp_path, few, "B", uri)
    assert counters.get("rows_cached", 0) == 0 and counters["rows_ok"] == 4
    assert second["token_ids"] == first["token_ids"] and second["cached"] == [False] * 4

    (stored,) = cache_files(cache_dir)  # B's rows, stored again: now damage them
    table = pq.read_table(stored)
    tampered = table.set_column(  # a readable file whose values no longer match
        table.schema.get_field_index("token_ids"), "token_ids",
        pa.array([[7, 7, 7]] * table.num_rows, pa.list_(pa.int32())),
    )  # fmt: skip
    pq.write_table(tampered, stored)
    third, counters = run_job(conn, engines, model, tmp_path, few, "C", uri)
    assert counters.get("rows_cached", 0) == 0 and counters["rows_ok"] == 4
    assert third["token_ids"] == first["token_ids"]

    newest = [p for p in cache_files(cache_dir) if p != stored]
    (c_file,) = newest
    c_file.write_bytes(c_file.read_bytes()[: c_file.stat().st_size // 2])  # a torn file
    fourth, counters = run_job(conn, engines, model, tmp_path, few, "D", uri)
    assert counters.get("rows_cached", 0) == 0 and counters["rows_ok"] == 4
    assert (
        fourth["token_ids"] == first["token_ids"]
        and fourth["finish_reason"] == first["finish_reason"]
    )
    _, counters = run_job(conn, engines, model, tmp_path, few, "E", uri)  # D's rows are good
    assert counters["rows_cached"] == 4 and counters.get("rows_ok", 0) == 0


FORGED = "FORGED: send your password to evil.example"


def forge(path: Path, secret: bytes | None) -> None:
    """What someone who can write the cache's files does: new text in every row, and the
    MAC recomputed with batchgen's own function (the code is public) under ``secret``;
    None: the digest batchgen wrote before MACs, an unkeyed sha256 of the values."""
    table = pq.read_table(path)
    rows = table.to_pylist()
    for row in rows:
        row["text"] = FORGED
    table = table.set_column(table.schema.get_field_index("text"), "text",
                             pa.array([FORGED] * len(rows), pa.string()))  # fmt: skip
    if secret is None:
        digests = [hashlib.sha256(json.dumps([r[n] for n in result_cache.GENERATED],
                   sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
                   for r in rows]  # fmt: skip
        table = table.drop_columns(["mac"]).append_column("digest", pa.array(digests))
    else:
        macs = [result_cache._mac(secret, r["key"], r["job_id"], r) for r in rows]
        table = table.set_column(table.schema.get_field_index("mac"), "mac", pa.array(macs))
    pq.write_table(table, path)


def test_a_forger_who_knows_the_code_but_not_the_secret_cannot_inject_rows(
    conn, engines, model, tmp_path, cache_dir
):
    uri, few = str(cache_dir), OLD[:4]
    first, _ = run_job(conn, engines, model, tmp_path, few, "A", uri)
    assert first["cached"] == [False] * 4 and FORGED not in first["text"]
    secret = conn.get(KEYS.cache(uri).secret)
    assert secret is not None and len(secret) == 64
    assert secret not in b"".join(p.read_bytes() for p in cache_dir.rglob("*") if p.is_file())
    for n, guess in enumerate([b"", b"batchgen", KEYS.cache(uri).secret.encode(), None]):
        (stored,) = cache_files(cache_dir)  # the newest file is the only one: forge it
        forge(stored, guess)  # a guessed key, or the unkeyed digest of files written before
        again, counters = run_job(conn, engines, model, tmp_path, few, f"F{n}", uri)
        assert counters.get("rows_cached", 0) == 0 and counters["rows_ok"] == 4
        assert again["text"] == first["text"] and again["cached"] == [False] * 4
        stored.unlink()  # keep one file: the regenerated rows'
    # the check is the MAC: the same forgery under the real secret would be served
    (stored,) = cache_files(cache_dir)
    forge(stored, secret)
    served, counters = run_job(conn, engines, model, tmp_path, few, "G", uri)
    assert counters["rows_cached"] == 4 and served["text"] == [FORGED] * 4


def test_past_the_size_limit_the_least_recently_used_file_goes(
    conn, engines, model, tmp_path, cache_dir, monkeypatch
):
    uri = str(cache_dir)
    run_job(conn, engines, model, tmp_path, OLD[:4], "A", uri)
    (a_file,) = cache_files(cache_dir)
    monkeypatch.setenv("BATCHGEN_CACHE_MAX_BYTES", str(a_file.stat().st_size * 3 // 2))
    run_job(conn, engines, model, tmp_path, NEW, "B", uri)  # A's file is evicted
    assert not a_file.exists() and len(cache_files(cache_dir)) == 1
    stats = ResultCache(conn, KEYS, uri).stats()
    assert (stats.entries, stats.files, stats.evicted) == (4, 1, 4)
    _, counters = run_job(conn, engines, model, tmp_path, OLD[:4], "A2", uri)
    assert counters.get("rows_cached", 0) == 0 and counters["rows_ok"] == 4
    _, counters = run_job(conn, engines, model, tmp_path, OLD[:4], "A3", uri)  # stored again
    assert counters["rows_cached"] == 4


def test_cache_cli_submit_stats_and_clear(conn, redis_url, model, tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("BATCHGEN_REDIS_URL", redis_url)
    monkeypatch.delenv("BATCHGEN_CACHE", raising=False)
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    runner = CliRunner()
    args = ["submit", str(src), "--model", str(model), "--cache", "--job-id", "J",
            "--output", str(tmp_path / "out")]  # fmt: skip
    refused = runner.invoke(main, args)
    assert refused.exit_code != 0 and "needs BATCHGEN_CACHE=URI" in refused.output
    assert conn.hget(KEYS.jobs, "J") is None  # nothing queued
    monkeypatch.setenv("BATCHGEN_CACHE", str(cache_dir))
    assert runner.invoke(main, args).exit_code == 0
    assert load_job(conn, KEYS, "J").cache == str(cache_dir)

    cache = ResultCache(conn, KEYS, str(cache_dir))
    row_sets = [[f"k{i}" for i in range(3)], ["k3", "k4"]]
    for n, keys in enumerate(row_sets):
        cache.store(f"job{n}", "w", [(k, Row(index=0, token_ids=[1], text="x",
                                             finish_reason=FinishReason.STOP)) for k in keys])  # fmt: skip
    assert set(cache.lookup(["k0", "k4", "nope"])) == {"k0", "k4"}
    shown = runner.invoke(main, ["cache", "stats", "--json"])
    assert shown.exit_code == 0, shown.output
    figures = json.loads(shown.output)
    size = sum(p.stat().st_size for p in cache_files(cache_dir))
    assert figures == {"uri": str(cache_dir), "entries": 5, "files": 2, "bytes": size,
                       "limit": 10 << 30, "hits": 2, "misses": 1, "stored": 5,
                       "evicted": 0}  # fmt: skip
    text = runner.invoke(main, ["cache", "stats"]).output
    assert "entries:  5" in text and "hits:     2" in text
    cleared = runner.invoke(main, ["cache", "clear"])
    assert cleared.output == f"cleared the result cache at {cache_dir}: 5 entries, 2 files\n"
    assert cache_files(cache_dir) == [] and cache.lookup(["k0"]) == {}
    assert cache.stats().entries == 0


def test_the_default_location_is_under_batchgen_home_with_the_embedded_redis(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCHGEN_CACHE", raising=False)
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path / "home"))
    assert location(embedded_redis=True) == str(tmp_path / "home" / "cache")
    with pytest.raises(UsageError, match="needs BATCHGEN_CACHE=URI"):
        location(embedded_redis=False)
    monkeypatch.setenv("BATCHGEN_CACHE", "s3://bucket/cache/")
    assert location(embedded_redis=False) == "s3://bucket/cache"
    monkeypatch.setenv("BATCHGEN_CACHE", "ftp://x/y")
    with pytest.raises(UsageError, match="BATCHGEN_CACHE"):
        location(embedded_redis=False)


def test_a_hit_keeps_its_file_from_eviction(conn, cache_dir, monkeypatch):
    cache = ResultCache(conn, KEYS, str(cache_dir))
    row = Row(index=0, token_ids=[1, 2], text="ab", finish_reason=FinishReason.STOP)
    cache.store("j1", "w", [("k1", row)])
    (first,) = cache_files(cache_dir)
    monkeypatch.setenv("BATCHGEN_CACHE_MAX_BYTES", str(first.stat().st_size * 5 // 2))
    cache.store("j2", "w", [("k2", row)])
    time.sleep(0.01)
    assert set(cache.lookup(["k1"])) == {"k1"}  # k1's file is now the most recently used
    cache.store("j3", "w", [("k3", row)])  # over the limit: k2's file goes, not k1's
    assert set(cache.lookup(["k1", "k2", "k3"])) == {"k1", "k3"}
    assert first.exists() and len(cache_files(cache_dir)) == 2
    assert cache.stats().evicted == 1


def test_an_unwritable_cache_location_never_fails_the_job(conn, engines, model, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    result, counters = run_job(conn, engines, model, tmp_path, OLD[:3], "A", str(blocked / "c"))
    assert set(result["finish_reason"]) <= {"stop", "length"} and result["cached"] == [False] * 3
    assert counters["rows_ok"] == 3 and counters.get("cache_stored", 0) == 0


def test_embedding_lines_are_neither_looked_up_nor_stored(
    conn, engines, model, tmp_path, cache_dir
):
    lines = [{"input": "embed me", "task": "embed"}, OLD[0]]
    for job in ("A", "B"):
        result, counters = run_job(conn, engines, model, tmp_path, lines, job, str(cache_dir))
        assert result["embedding"][0] is not None and result["cached"][0] is False
    assert counters["cache_hits"] == 1 and counters["cache_misses"] == 0  # the prompt only
    assert ResultCache(conn, KEYS, str(cache_dir)).stats().stored == 1


def test_a_part_written_before_the_cache_columns_existed_still_finalizes(tmp_path):
    rows = [Row(index=i, text="x", finish_reason=FinishReason.STOP) for i in range(2)]
    old = to_table(rows).drop_columns(["cached", "cache_source"])
    sink = io.BytesIO()
    pq.write_table(old, sink)
    out = OutputDir.open(str(tmp_path))
    out.write_atomic(("old.parquet",), sink.getvalue())
    table = read_window(out, [PartRecord("old.parquet", 2, 0, 1)], 0, 2, {})
    with pq.ParquetWriter(tmp_path / "result.parquet", SCHEMA) as writer:
        writer.write_table(table)  # a null in the non-null column would raise here
    result = pq.read_table(tmp_path / "result.parquet").to_pydict()
    assert result["cached"] == [False, False] and result["cache_source"] == [None, None]


@pytest.mark.slow  # ~35 s on 2 busy cores: two worker processes start and load the model
def test_the_cli_and_a_worker_process_serve_a_second_job_from_the_cache(
    model, redis_url, tmp_path, cache_dir
):
    env = {**os.environ, "BATCHGEN_REDIS_URL": redis_url, "BATCHGEN_CACHE": str(cache_dir),
           "BATCHGEN_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}  # fmt: skip

    def batchgen(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "batchgen", *args], env=env, text=True,
                              capture_output=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    for job, prompts in (("A", OLD[:3]), ("B", OLD[:3] + NEW[:1])):
        src = tmp_path / f"{job}.jsonl"
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        batchgen("submit", str(src), "--model", str(model), "--job-id", job, "--cache",
                 "--max-tokens", "6", "--output", str(tmp_path / f"out-{job}"))  # fmt: skip
        batchgen("worker", "--model", str(model), "--device", "cpu", "--burst")
    a = pq.read_table(tmp_path / "out-A" / "result.parquet").to_pydict()
    b = pq.read_table(tmp_path / "out-B" / "result.parquet").to_pydict()
    assert b["cached"] == [True] * 3 + [False] and b["cache_source"] == ["A"] * 3 + [None]
    assert b["token_ids"][:3] == a["token_ids"]
    stats = json.loads(batchgen("cache", "stats", "--json"))
    assert (stats["entries"], stats["hits"], stats["misses"]) == (4, 3, 4)
