"""A newcomer's mistakes, made as a user makes them (``batchgen`` processes, the embedded
Redis or a private one): each is one line on stderr with the exact text, a non-zero
exit, and nothing queued or started behind it."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from batchgen.jobs.intake.duplicate_ids import MEMORY_BYTES, IdLog, find_duplicates
from batchgen.jobs.redis import embedded
from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.entry import QueuedRequest
from tests.cli_session import Shell, shells, wait_for, write_jsonl


@pytest.fixture
def here(tmp_path: Path, toy_model) -> Path:
    """The user's working directory: a checkpoint ``tiny`` and a prompts file."""
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "max_tokens": 2}])
    return tmp_path


@pytest.fixture
def local(here: Path) -> Iterator[Shell]:
    """The embedded Redis, in a home of this test's own."""
    yield from shells(here, here / "home")
    if embedded.redis_dir(here / "home").is_dir():
        embedded.stop(here / "home")


@pytest.fixture
def shared(here: Path, private_redis: RedisServer) -> Iterator[Shell]:
    yield from shells(here, here / "home", private_redis.url)


def one_line(out, code: int = 2) -> str:
    assert out.returncode == code, out.stderr
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


TYPO = "batchgen: error: model path ./tyni does not exist (did you mean ./tiny?)"


def test_a_mistyped_model_path_is_refused_by_submit_run_and_worker_with_nothing_left(local):
    assert one_line(local.run("submit", "p.jsonl", "--model", "./tyni")) == TYPO
    assert one_line(local.run("run", "p.jsonl", "--model", "./tyni", "-o", "o.parquet")) == TYPO
    out = local.run("worker", "--model", "./tyni", "--device", "cpu", "--burst")
    assert one_line(out) == TYPO  # before any engine process: no traceback, no restarts
    assert local.ok("jobs") == "no jobs\n"
    assert not (local.cwd / "o.parquet").exists()


def test_a_hub_id_says_what_batchgen_needs_instead(local):
    out = local.run("submit", "p.jsonl", "--model", "meta-llama/Llama-3.1-8B")
    assert one_line(out) == (
        "batchgen: error: model 'meta-llama/Llama-3.1-8B' is not a directory here, and "
        "batchgen downloads nothing: put the checkpoint in a directory (`hf download "
        "meta-llama/Llama-3.1-8B --local-dir DIR`, say: the `hf` command comes with "
        "transformers) and pass --model DIR"
    )
    # the command it names is the one the install ships (huggingface_hub 1.x: `hf`)
    assert (Path(sys.executable).parent / "hf").is_file()


def test_a_directory_that_is_no_checkpoint_is_refused_before_anything_is_queued(local):
    (local.cwd / "notes").mkdir()
    (local.cwd / "notes" / "a.txt").write_text("x")
    assert one_line(local.run("submit", "p.jsonl", "--model", "notes")).startswith(
        "batchgen: error: notes has no config.json: not a checkpoint directory"
    )
    binonly = local.cwd / "binonly"
    shutil.copytree(local.cwd / "tiny", binonly)
    (binonly / "model.safetensors").unlink()
    (binonly / "pytorch_model.bin").write_bytes(b"\0")
    assert one_line(local.run("submit", "p.jsonl", "--model", "binonly")) == (
        "batchgen: error: binonly holds PyTorch .bin weights; batchgen reads only safetensors "
        "(convert with transformers: model.save_pretrained(dir))"
    )
    assert local.ok("jobs") == "no jobs\n"


def test_an_architecture_batchgen_does_not_run_stops_the_worker_at_once(shared):
    """The config names no native family: the engine process says so in one line, and
    the worker exits 2 instead of restarting it five times."""
    bert = shared.cwd / "bert"
    shutil.copytree(shared.cwd / "tiny", bert)
    config = json.loads((bert / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (bert / "config.json").write_text(json.dumps(config))
    line = one_line(shared.run("worker", "--model", "bert", "--device", "cpu", "--burst"))
    refusal = ("batchgen: error: BertForMaskedLM is not the causal LM transformers builds "
               "for model_type 'llama' (LlamaForCausalLM)")  # fmt: skip
    assert line == refusal
    line = one_line(shared.run("run", "p.jsonl", "--model", "bert", "-o", "o.parquet",
                               "--job-output", str(shared.cwd / "job")))  # fmt: skip
    assert line == refusal
    assert shared.ok("jobs") == "no jobs\n"


def test_a_shared_redis_takes_a_model_that_lives_on_the_workers_with_a_warning(shared):
    out = shared.run("submit", "p.jsonl", "--model", "/models/llama", "--job-id", "j",
                     "--output", str(shared.cwd / "out"))  # fmt: skip
    assert (out.returncode, out.stdout) == (0, "j\n")
    assert out.stderr == (
        "batchgen: warning: /models/llama is not a checkpoint directory on this machine and no "
        "live worker serves it; the job waits for `batchgen worker --model /models/llama` on "
        "a host that has it\n"
    )


def test_usage_mistakes_are_one_line_with_a_suggestion(local):
    assert one_line(local.run("sumbit", "p.jsonl")) == (
        "batchgen: error: No such command 'sumbit'. Did you mean 'submit'? "
        "(`batchgen --help` says more)"
    )
    assert one_line(local.run("submit", "p.jsonl", "--model", "tiny", "--max-token", "3")) == (
        "batchgen: error: No such option '--max-token'. Did you mean '--max-tokens'? "
        "(`batchgen submit --help` says more)"
    )
    assert one_line(local.run("status", "--watch", "--json", "extra", "args")) == (
        "batchgen: error: Got unexpected extra argument (args) (`batchgen status --help` says more)"
    )
    assert one_line(local.run("cache", "stat")) == (
        "batchgen: error: No such command 'stat'. Did you mean 'stats'? "
        "(`batchgen cache --help` says more)"
    )


def test_a_template_column_typo_gets_a_did_you_mean(local):
    pq.write_table(pa.table({"title": ["a"], "body": ["b"]}), local.cwd / "t.parquet")
    out = local.run("submit", "t.parquet", "--model", "tiny", "--template", "{titel}: {body}")
    assert one_line(out) == (
        "batchgen: error: --template: no column 'titel' in the input; did you mean 'title'? "
        "(its columns: title, body)"
    )


def test_an_engine_setting_typo_gets_the_same_did_you_mean_everywhere(toy_model):
    from batchgen import Engine
    from batchgen.worker.engine_config import EngineConfig

    message = "^" + re.escape(
        "unknown engine setting 'max_num_seq' (did you mean 'max_num_seqs'?); the settings are "
    )
    with pytest.raises(TypeError, match=message):
        EngineConfig(max_num_seq=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=message):
        Engine.from_pretrained(toy_model("llama"), max_num_seq=3)


def test_every_command_that_uses_redis_takes_the_redis_flag():
    """What docs/commands.md says: all but toy-model and redis."""
    import click

    from batchgen.cli import COMMANDS, main

    ctx = click.Context(main)
    without = set()
    for name in COMMANDS:
        command = main.get_command(ctx, name)
        assert command is not None
        subcommands = command.commands.values() if isinstance(command, click.Group) else [command]
        for sub in subcommands:
            if not any("--redis" in p.opts for p in sub.params):
                without.add(name)
    assert without == {"toy-model", "redis"}


def test_download_never_overwrites_nor_makes_folders_unless_asked(shared):
    shared.ok("run", "p.jsonl", "--model", "tiny", "-o", "first.parquet", "--job-id", "d",
              "--job-output", str(shared.cwd / "job"))  # fmt: skip
    first = (shared.cwd / "first.parquet").read_bytes()
    (shared.cwd / "mine.parquet").write_bytes(b"precious")
    out = shared.run("download", "d", "-o", "mine.parquet")
    assert one_line(out) == (
        "batchgen: error: mine.parquet exists; pass --force to overwrite it, or choose another -o"
    )
    assert (shared.cwd / "mine.parquet").read_bytes() == b"precious"
    out = shared.run("download", "d", "-o", "nosuch/dir/x.parquet")
    assert one_line(out) == (
        "batchgen: error: the folder nosuch/dir does not exist; create it first "
        "(mkdir -p nosuch/dir)"
    )
    assert not (shared.cwd / "nosuch").exists()
    assert shared.ok("download", "d", "-o", "mine.parquet", "--force") == (
        "wrote 1 rows to mine.parquet\n"
    )
    assert (shared.cwd / "mine.parquet").read_bytes() == first
    out = shared.run("run", "p.jsonl", "--model", "tiny", "-o", "first.parquet",
                     "--job-output", str(shared.cwd / "job2"))  # fmt: skip
    assert one_line(out) == (
        "batchgen: error: first.parquet exists; pass --force to overwrite it, or choose another -o"
    )
    assert redis.Redis.from_url(shared.env["BATCHGEN_REDIS_URL"]).hlen("bg:jobs") == 1


def test_ids_given_twice_get_a_warning_and_keep_their_rows(shared):
    lines = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "x"}, {"id": "a", "prompt": "y"},
             {"prompt": "no id"}, {"id": 'q\\"', "prompt": "y"}, {"id": 'q\\"', "prompt": "z"}]  # fmt: skip
    write_jsonl(shared.cwd / "dup.jsonl", lines)
    out = shared.run("submit", "dup.jsonl", "--model", "tiny", "--job-id", "dup",
                     "--output", str(shared.cwd / "dup"))  # fmt: skip
    assert (out.returncode, out.stdout) == (0, "dup\n")
    assert out.stderr == (
        "batchgen: warning: 2 line(s) repeat the id of an earlier line (line 3 has the id of "
        "line 1); each still has its own row, told apart by index\n"
        f"batchgen: note: no worker serves {shared.cwd / 'tiny'} yet, so the job waits; start "
        f"one with `batchgen worker --model {shared.cwd / 'tiny'}`\n"
    )
    assert shared.status("dup")["total"] == 6


def test_repeated_ids_are_found_the_same_in_buckets_as_in_memory(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 3000, 5000)
    logs = []
    for part in range(3):  # three validating processes' logs
        log = IdLog(tmp_path / f"ids-{part}")
        for where in range(part * 2000, min((part + 1) * 2000, 5000)):
            log.add(QueuedRequest(id=f"id{ids[where]}", prompt="p").encode(), where)
        log.close()
        logs.append(tmp_path / f"ids-{part}")
    first_seen: dict[int, int] = {}
    expected_first = None
    for where, value in enumerate(ids):
        if value in first_seen and expected_first is None:
            expected_first = (first_seen[value], where)
        first_seen.setdefault(value, where)
    expected = len(ids) - len(first_seen)
    # what input.md says: 16 bytes an id on disk, and memory within the bound (64 MB, here
    # scaled down to the test's 80 kB of ids: one bucket, then several)
    assert sum(p.stat().st_size for p in logs) == 16 * len(ids)
    assert MEMORY_BYTES == 64 << 20
    found = []
    for memory_bytes in (MEMORY_BYTES, 400_000, 200_000, 100_000):  # 1, 1, 2, 4 buckets
        tracemalloc.start()
        found.append(find_duplicates(logs, tmp_path, memory_bytes=memory_bytes))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= memory_bytes, (memory_bytes, peak)
    assert {(f.count, f.first) for f in found} == {(expected, expected_first)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids-0", "ids-1", "ids-2"]


def test_a_submit_no_worker_serves_says_how_to_start_one(shared):
    """A job no worker serves gets a note on stderr naming the command that starts one,
    at a terminal and in a script that captures both streams (stdout: the job id alone,
    or the JSON); with a live worker for the model, only the job id. A local model folder
    is named by its absolute path however it was typed: in the note, the job, the worker."""
    tiny = str(shared.cwd / "tiny")
    note = (f"batchgen: note: no worker serves {tiny} yet, so the job waits; start one with "
            f"`batchgen worker --model {tiny}`\n")  # fmt: skip
    out = shared.at_terminal("submit", "p.jsonl", "--model", "./tiny", "--job-id", "alone",
                             "--output", str(shared.cwd / "alone"))  # fmt: skip
    assert (out.returncode, out.stdout, out.stderr) == (0, "alone\n", note)
    piped = shared.run("submit", "p.jsonl", "--model", "./tiny", "--job-id", "piped",
                       "--output", str(shared.cwd / "piped"))  # fmt: skip
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, "piped\n", note)
    as_json = shared.run("submit", "p.jsonl", "--model", "./tiny", "--job-id", "json",
                         "--output", str(shared.cwd / "json"), "--json")  # fmt: skip
    assert (json.loads(as_json.stdout)["job_id"], as_json.stderr) == ("json", note)
    assert shared.status("alone")["model"] == tiny
    assert shared.ok("jobs").endswith(f"  {tiny}\n")
    shared.start("worker", "--model", "tiny", "--device", "cpu")  # another spelling, same queue
    wait_for(
        lambda: all(shared.status(j)["state"] == "completed" for j in ("alone", "piped", "json")),
        "the worker to run them",
    )
    conn = redis.Redis.from_url(shared.env["BATCHGEN_REDIS_URL"])
    assert [w["model"] for w in live_workers(conn, Keys())] == [tiny]
    out = shared.at_terminal("submit", "p.jsonl", "--model", "tiny", "--job-id", "served",
                             "--output", str(shared.cwd / "served"))  # fmt: skip
    assert (out.returncode, out.stdout, out.stderr) == (0, "served\n", "")
