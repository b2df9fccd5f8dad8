"""Tenants from the command line: quotas refuse a submit before anything is queued,
``batchgen tenant`` sets and lists them, ``status`` shows a job's class, deadline
and usage."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.ops.fair_share import backlog, tenants
from batchgen.jobs.ops.fair_share.schedule import default_tenant, parse_deadline
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.redis import embedded
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.errors import UsageError
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.serve.batch.batch_record import BatchRecord, to_openai
from batchgen.worker.consumer.commit import PartCommit, commit
from batchgen.worker.consumer.queue import read_new
from tests.doc_blocks import doc_block, run_sh, shell_env

KEYS = Keys("bg")
QK = KEYS.queue_for_model("m")


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def cli(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, list(args), env=env)


def prompts(tmp_path: Path, n: int, name: str, chars: int = 40) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i:03d}" + "x" * (chars - 3)}) + "\n"
                            for i in range(n)))  # fmt: skip
    return path


def submit(redis_url: str, tmp_path: Path, job_id: str, n: int, *flags: str) -> Any:
    return cli("submit", str(prompts(tmp_path, n, job_id)), "--model", "m", "--job-id", job_id,
               "--output", str(tmp_path / f"out-{job_id}"), "--redis", redis_url, *flags)  # fmt: skip


def test_a_submit_past_a_quota_is_refused_before_anything_is_queued(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = cli("tenant", "set", "acme", "--max-jobs", "2", "--max-enqueued-tokens", "1000",
              "--weight", "2", "--redis", redis_url)  # fmt: skip
    assert out.exit_code == 0, out.output
    assert (
        out.output
        == "tenant acme: weight 2, max enqueued tokens 1000, max jobs 2, max priority none\n"
    )
    first = submit(redis_url, tmp_path, "a1", 10, "--tenant", "acme")
    assert first.exit_code == 0, first.output
    # each line's request is {"p":"<40 chars>","s":{...}}: 47 bytes before the sampling
    # fields, 12 tokens estimated; 10 lines hold 120 of the tenant's 1000
    assert load_job(conn, KEYS, "a1").est_input_tokens == 120
    big = submit(redis_url, tmp_path, "a2", 80, "--tenant", "acme")
    assert big.exit_code == 3
    assert big.output == (
        "batchgen: error: Enqueued token limit reached for m by tenant 'acme'. Limit: 1,000 enqueued "
        "tokens; unfinished jobs hold 120 and this one needs 960 (estimated). Please try again "
        "once some in_progress jobs have been completed. Nothing was queued.\n"
    )
    assert conn.hget(KEYS.jobs, "a2") is None and not conn.exists(QK.job("a2").job)
    assert not (tmp_path / "out-a2").exists() and backlog.queued(conn, QK, "a2") == []
    assert submit(redis_url, tmp_path, "a3", 10, "--tenant", "acme").exit_code == 0
    third = submit(redis_url, tmp_path, "a4", 1, "--tenant", "acme")
    assert third.exit_code == 3 and "Concurrent job limit reached for tenant 'acme': 2" in (
        third.output)  # fmt: skip
    # the same job submitted again (a resumed submit) is not counted twice
    assert submit(redis_url, tmp_path, "a1", 10, "--tenant", "acme").exit_code == 0
    # another tenant is not held to acme's quotas
    assert submit(redis_url, tmp_path, "b1", 80, "--tenant", "bravo").exit_code == 0
    listed = json.loads(cli("tenant", "list", "--json", "--redis", redis_url).output)
    assert [(t["tenant"], t["weight"], t["jobs"], t["enqueued_tokens"], t["max_jobs"])
            for t in listed] == [("acme", 2.0, 2, 240, 2), ("bravo", 1.0, 1, 960, None)]  # fmt: skip
    # a job that finishes frees its share
    conn.hset(QK.job("a1").job, "state", "completed")
    assert submit(redis_url, tmp_path, "a4", 1, "--tenant", "acme").exit_code == 0
    # a3 and a4 hold both jobs acme may have; 'none' lifts the limit
    assert submit(redis_url, tmp_path, "a5", 1, "--tenant", "acme").exit_code == 3
    out = cli("tenant", "set", "acme", "--max-jobs", "none", "--redis", redis_url)
    assert out.output == (
        "tenant acme: weight 2, max enqueued tokens 1000, max jobs none, max priority none\n"
    )
    assert submit(redis_url, tmp_path, "a5", 1, "--tenant", "acme").exit_code == 0


def test_a_class_above_the_tenants_max_priority_is_refused(redis_url, tmp_path):
    """From the CLI a tenant without --max-priority may ask for any class (serve's keys:
    tests/test_serve_api.py); with one, a job above it is refused before anything is
    queued, one at it runs."""
    conn = rconn(redis_url)
    assert (
        submit(redis_url, tmp_path, "top", 1, "--tenant", "acme", "--priority", "1000").exit_code
        == 0
    )
    assert load_job(conn, KEYS, "top").priority == 1000
    out = cli("tenant", "set", "acme", "--max-priority", "5", "--redis", redis_url)
    assert out.output == ("tenant acme: weight 1, max enqueued tokens none, max jobs none, "
                          "max priority 5\n")  # fmt: skip
    refused = submit(redis_url, tmp_path, "six", 1, "--tenant", "acme", "--priority", "6")
    assert (refused.exit_code, refused.output) == (2, (
        "batchgen: error: priority 6: tenant 'acme' may ask for class 5 at most (its "
        "--max-priority); nothing was queued\n"))  # fmt: skip
    assert conn.hget(KEYS.jobs, "six") is None and not (tmp_path / "out-six").exists()
    assert (
        submit(redis_url, tmp_path, "five", 1, "--tenant", "acme", "--priority", "5").exit_code == 0
    )
    assert (
        submit(redis_url, tmp_path, "other", 1, "--tenant", "bravo", "--priority", "9").exit_code
        == 0
    )
    (acme,) = [t for t in json.loads(cli("tenant", "list", "--json", "--redis", redis_url).output)
               if t["tenant"] == "acme"]  # fmt: skip
    assert acme["max_priority"] == 5
    out = cli("tenant", "set", "acme", "--max-priority", "1001", "--redis", redis_url)
    assert (out.exit_code, out.output) == (
        2, "batchgen: error: priority 1001: give a class from -1000 to 1000\n")  # fmt: skip
    cli("tenant", "set", "acme", "--max-priority", "none", "--redis", redis_url)
    assert (
        submit(redis_url, tmp_path, "six", 1, "--tenant", "acme", "--priority", "6").exit_code == 0
    )


def test_a_retry_reserves_quota_like_a_submit_and_frees_it_when_the_job_ends(redis_url, tmp_path):
    """A cancelled, finalized job retried with --all-failed holds one more unfinished job
    and its retried rows' estimated tokens (12 a line here): past a quota it is refused
    with submit's error and nothing changes; its share is freed when it ends again."""
    conn = rconn(redis_url)

    def run(*args: str) -> Any:
        return cli(*args, "--redis", redis_url)

    def held() -> tuple[int, int]:
        (acme,) = [t for t in json.loads(run("tenant", "list", "--json").output)
                   if t["tenant"] == "acme"]  # fmt: skip
        return acme["jobs"], acme["enqueued_tokens"]

    def end(job_id: str) -> None:
        assert run("cancel", job_id).exit_code == 0
        out = run("finalize", job_id)
        assert out.exit_code == 0, out.output

    assert run("tenant", "set", "acme", "--max-jobs", "1").exit_code == 0
    assert submit(redis_url, tmp_path, "r1", 3, "--tenant", "acme").exit_code == 0
    end("r1")
    assert held() == (0, 0)
    assert submit(redis_url, tmp_path, "r2", 1, "--tenant", "acme").exit_code == 0
    refused = run("retry", "r1", "--all-failed")
    assert (refused.exit_code, refused.output) == (3, (
        "batchgen: error: Concurrent job limit reached for tenant 'acme': 1 unfinished jobs at "
        "most. Please try again once one has been completed. Nothing was queued.\n"))  # fmt: skip
    record = load_job(conn, KEYS, "r1")
    assert (record.state.value, record.retry_rounds, held()) == ("cancelled", 0, (1, 12))
    end("r2")
    assert run("retry", "r1", "--all-failed").exit_code == 0
    assert (load_job(conn, KEYS, "r1").state.value, held()) == ("running", (1, 36))
    assert submit(redis_url, tmp_path, "r3", 1, "--tenant", "acme").exit_code == 3
    end("r1")
    assert held() == (0, 0)
    assert run("finalize", "r1").exit_code == 0  # finalized again: nothing released twice
    run("tenant", "set", "acme", "--max-jobs", "none", "--max-enqueued-tokens", "40")
    assert submit(redis_url, tmp_path, "r3", 1, "--tenant", "acme").exit_code == 0
    refused = run("retry", "r1", "--all-failed")
    assert (refused.exit_code, refused.output) == (3, (
        "batchgen: error: Enqueued token limit reached for m by tenant 'acme'. Limit: 40 "
        "enqueued tokens; unfinished jobs hold 12 and this one needs 36 (estimated). Please try "
        "again once some in_progress jobs have been completed. Nothing was queued.\n"))  # fmt: skip
    assert (load_job(conn, KEYS, "r1").retry_rounds, held()) == (1, (1, 12))


def test_a_share_whose_job_was_never_created_is_dropped_after_a_minute(redis_url):
    conn = rconn(redis_url)
    tk = KEYS.tenant("t")
    now = time.time()
    for job_id, since in (("died-before-create", int(now) - 61), ("creating-now", int(now))):
        tenants.RESERVE(conn, settings=tk.settings, jobs=tk.jobs, held=tk.held, job_id=job_id,
                        tokens=500, now=since)  # fmt: skip
    assert tenants.holding(conn, KEYS, "t") == {"jobs": 2, "enqueued_tokens": 1000}
    assert tenants.prune(conn, KEYS, "t", now) == ["died-before-create"]
    assert tenants.holding(conn, KEYS, "t") == {"jobs": 1, "enqueued_tokens": 500}


def test_status_shows_class_deadline_and_usage(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = submit(redis_url, tmp_path, "d", 3, "--tenant", "ops", "--priority", "7",
                 "--deadline", "2h", "--expire")  # fmt: skip
    assert out.exit_code == 0, out.output
    d, e = read_new(conn, QK, "w", 2)
    row = Row(index=d.index, finish_reason=FinishReason.STOP, prompt_tokens=9, cached_tokens=4,
              completion_tokens=5)  # fmt: skip
    # a failed request is not billed (OpenAI bills none): its input tokens counted apart
    refused = Row(index=e.index, finish_reason=FinishReason.ERROR, prompt_tokens=600_001,
                  error="prompt is 600001 tokens; the model's context is 2048 tokens")  # fmt: skip
    (tmp_path / "out-d" / "parts").mkdir(exist_ok=True)
    commit(conn, QK, [PartCommit("d", "parts/x.parquet", [row, refused], [d.entry_id, e.entry_id],
                                 0, engine_us=[250_000, 0])])  # fmt: skip
    status = json.loads(cli("status", "d", "--json", "--redis", redis_url).output)
    assert (status["tenant"], status["priority"]) == ("ops", 7)
    assert status["usage"] == {"input_tokens": 9, "cached_input_tokens": 4, "output_tokens": 5,
                               "engine_s": 0.25, "failed_input_tokens": 600_001}  # fmt: skip
    batch = BatchRecord(id="d", endpoint="/v1/completions", input_file_id="f")
    assert to_openai(batch, load_job(conn, KEYS, "d"))["usage"] == {
        "input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14,
        "failed_input_tokens": 600_001,
    }  # fmt: skip
    deadline = status["deadline"]
    assert deadline["deadline"] == pytest.approx(time.time() + 7200, abs=60)
    assert (deadline["state"], deadline["expire"]) == ("unknown", True)
    text = cli("status", "d", "--redis", redis_url).output
    assert "tenant     ops, priority 7\n" in text
    assert ("usage      in 9 tokens (4 cached), out 5, engine 0.2s; failed requests' input "
            "600001 (not billed)\n") in text  # fmt: skip
    assert "deadline   " in text and ": no rate measured yet" in text
    listed = json.loads(cli("tenant", "list", "--json", "--redis", redis_url).output)
    assert listed[0]["usage"] == {"requests": 2, "input_tokens": 9, "cached_input_tokens": 4,
                                  "output_tokens": 5, "engine_s": 0.25,
                                  "failed_input_tokens": 600_001}  # fmt: skip


def test_flags_are_checked_before_anything_is_read(redis_url, tmp_path, monkeypatch):
    bad = [("--priority", "1001", "priority 1001: give a class from -1000 to 1000"),
           ("--deadline", "soon", "--deadline 'soon': give a duration from now"),
           ("--tenant", "a b", "tenant 'a b': use letters, digits")]  # fmt: skip
    for flag, value, message in bad:
        out = submit(redis_url, tmp_path, "f", 1, flag, value)
        assert out.exit_code == 2 and message in out.output, out.output
    out = submit(redis_url, tmp_path, "f", 1, "--expire")
    assert out.exit_code == 2 and "--expire cancels the job at its --deadline" in out.output
    assert rconn(redis_url).hget(KEYS.jobs, "f") is None
    monkeypatch.setenv("BATCHGEN_TENANT", "team-a")
    assert default_tenant() == "team-a"
    assert parse_deadline("90m", now=1000.0) == 1000.0 + 5400
    with pytest.raises(UsageError, match="is not after now"):
        parse_deadline("2001-01-01T00:00")


def test_the_fair_share_block(tmp_path, toy_model):
    """docs/fair-share.md's block as a reader runs it: embedded Redis, no worker yet."""
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    for name, n in (("big", 6), ("urgent", 2)):
        prompts(tmp_path, n, name)
    env = shell_env(tmp_path / "home")
    try:
        out = run_sh(doc_block("fair-share"), tmp_path, env)
        assert "research" in out.stdout and "ops" in out.stdout
        status, listed = (json.loads(subprocess.run(["batchgen", *args, "--json"], cwd=tmp_path,
                                                    env=env, capture_output=True,
                                                    check=True).stdout)
                          for args in (["status"], ["tenant", "list"]))  # fmt: skip
    finally:
        embedded.stop(tmp_path / "home")
    jobs = sorted((s["tenant"], s["total"], s["priority"], s["state"], bool(s["deadline"]))
                  for s in status)  # fmt: skip
    assert jobs == [("ops", 2, 5, "queued", True), ("research", 6, 0, "queued", False)]
    research = next(t for t in listed if t["tenant"] == "research")
    assert (research["weight"], research["max_enqueued_tokens"], research["max_jobs"],
            research["jobs"]) == (3.0, 2_000_000, 10, 1)  # fmt: skip
    assert research["enqueued_tokens"] > 0


def test_weights_are_bounded_and_the_fair_clocks_outlive_no_busy_period(redis_url, tmp_path):
    """After a tenant of the smallest weight ran alone (its clocks raced ahead a thousand
    times its tokens), two tenants at 3:1 get exactly 3:1; so they do after clocks an
    older version left at 5e302 (a weight of 1e-300 ran alone)."""
    conn = rconn(redis_url)
    for weight in ("1e-300", "1e-320", "inf", "nan", "0", "-1", "0.0009", "1001"):
        out = cli("tenant", "set", "tiny", "--weight", weight, "--redis", redis_url)
        assert out.exit_code == 2, (weight, out.output)
        shown = f"{float(weight):g}"
        assert out.output == (f"batchgen: error: tenant 'tiny': --weight {shown}: give a weight "
                              "from 0.001 to 1000\n"), out.output  # fmt: skip
    assert not conn.exists(KEYS.tenant("tiny").settings)
    with pytest.raises(UsageError, match=r"give a weight from 0\.001 to 1000"):
        tenants.save(conn, KEYS, tenants.Tenant("tiny", weight=float("inf")))
    for name, weight in (("tiny", "0.001"), ("heavy", "3"), ("light", "1")):
        assert cli("tenant", "set", name, "--weight", weight, "--redis", redis_url).exit_code == 0

    def job(job_id: str, tenant: str, n: int) -> None:
        out = submit(redis_url, tmp_path, job_id, n, "--tenant", tenant)
        assert out.exit_code == 0, out.output

    def shares(reads: int) -> Counter:
        return Counter(d.job_id for _ in range(reads) for d in read_new(conn, QK, "w", 16))

    job("alone", "tiny", 200)
    assert shares(13) == {"alone": 200}  # the last read empties its backlog: the model idles
    assert conn.hkeys(QK.fair) == [b"w:tiny"]  # its clocks are gone, its weight stays
    job("h1", "heavy", 800)
    job("l1", "light", 800)
    assert shares(32) == {"h1": 384, "l1": 128}  # 3 quanta of 16 to 1, every 4 quanta
    assert shares(68) == {"h1": 416, "l1": 672}  # the rest of both: the model idles again
    conn.hset(QK.fair, mapping={"clock": 5e302, "t:tiny": 5e302, "c:tiny": 5e302})
    assert read_new(conn, QK, "w", 16) == []  # a worker's poll finds the model idle
    job("h2", "heavy", 800)
    job("l2", "light", 800)
    assert shares(32) == {"h2": 384, "l2": 128}
