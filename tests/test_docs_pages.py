"""The blocks of docs/*.md: each run as written (private embedded Redis, toy checkpoint,
moto's S3), or, where it needs a GPU, Docker, the network or minutes, checked without
running it as its marker says."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.jobs.intake.inputs import parse_line
from batchgen.jobs.intake.lines import LineError
from batchgen.jobs.redis import embedded
from batchgen.jobs.redis.redis_server import free_port
from batchgen.jobs.schema.sampling import DEFAULTS
from tests.doc_blocks import REPO, doc_block, replaced, run_sh, shell_env, start_sh, stop


@pytest.fixture
def workspace(tmp_path: Path, toy_model) -> Iterator[Path]:
    """A reader's working directory: the toy checkpoint as ./tiny (and ./m), the embedded
    Redis under ./home, stopped afterwards."""
    for name in ("tiny", "m"):
        (tmp_path / name).symlink_to(toy_model("llama"))
    yield tmp_path
    if (tmp_path / "home" / "redis").exists():
        embedded.stop(tmp_path / "home")


def s3_env(workspace: Path, endpoint: str) -> dict[str, str]:
    return shell_env(workspace / "home", AWS_ENDPOINT_URL=f"http://{endpoint}",
                     AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                     AWS_DEFAULT_REGION="us-east-1")  # fmt: skip


def bucket(endpoint: str) -> pafs.S3FileSystem:
    """The docs' ``s3://bucket``, on moto's server."""
    store = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", access_key="testing",
                              secret_key="testing", allow_bucket_creation=True)  # fmt: skip
    store.create_dir("bucket")
    return store


def jsonl(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("name", ["input-lines", "embedding-lines"])
def test_the_input_examples_are_accepted_as_written(name: str):
    entries = []
    for number, line in enumerate(doc_block(name).text.splitlines(), 1):
        out = parse_line(number, line.encode(), DEFAULTS)
        assert not isinstance(out, LineError), f"line {number}: {out}"
        entries.append(json.loads(out))
    if name == "embedding-lines":
        assert [e["e"] for e in entries] == ["some text", [101, 2023, 102]]
    else:
        assert len(entries) == 4 and not any("e" in e for e in entries)


def test_the_toy_model_block(tmp_path: Path):
    from safetensors import safe_open

    run_sh(doc_block("toy-model"), tmp_path, shell_env(tmp_path / "home"))
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"]) == ("llama", 8192)
    with safe_open(str(tmp_path / "tiny" / "model.safetensors"), framework="pt") as f:
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert 5.5e6 < params < 6.5e6  # "≈ 6M parameters"


def test_the_small_toy_size_is_what_the_page_says():
    import torch
    from transformers import AutoModelForCausalLM

    from batchgen.toy.checkpoint import SIZES, _config

    config = _config("qwen3", SIZES["small"], "float32", eos_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert (config.vocab_size, round(params / 1e8, 1)) == (32000, 1.0)  # "≈ 100M", 32000


def test_the_tables_block(workspace: Path, s3_endpoint: str):
    store = bucket(s3_endpoint)
    table = pa.table({
        "doc_id": ["d1", "d2", "d3", "d4"],
        "title": ["Tides", "Redis", "Parquet", "Kernels"],
        "body": ["The sea comes in.", "A key-value store.", "Columns on disk.", "Fast ops."],
        "url": [f"https://example.com/{i}" for i in range(4)],
        "published": pa.array([1_700_000_000_000 + i for i in range(4)], pa.timestamp("ms")),
        "temp": [0.0, 0.0, 0.0, 0.0],  # --sampling-columns temperature=temp
    })  # fmt: skip
    pq.write_table(table.slice(0, 2), "bucket/docs/part-0.parquet", filesystem=store)
    pq.write_table(table.slice(2), "bucket/docs/part-1.parquet", filesystem=store)
    with store.open_output_stream("bucket/docs/_SUCCESS") as out:
        out.write(b"")  # skipped: its name starts with _
    run_sh(doc_block("tables"), workspace, s3_env(workspace, s3_endpoint))
    got = pq.read_table(workspace / "summaries.parquet")
    assert got.column_names[-3:] == ["doc_id", "url", "published"]
    assert got.schema.field("published").type == pa.timestamp("ms")
    rows = got.to_pydict()
    assert rows["id"] == rows["doc_id"] == ["d1", "d2", "d3", "d4"]
    assert rows["url"] == table["url"].to_pylist()
    assert all(0 < n <= 128 for n in rows["completion_tokens"])


def test_the_cache_block(workspace: Path, s3_endpoint: str):
    store = bucket(s3_endpoint)
    lines = [
        {"id": f"p{i}", "prompt": f"Cached prompt number {i}", "max_tokens": 6} for i in range(4)
    ]
    jsonl(workspace / "prompts.jsonl", lines)
    jsonl(
        workspace / "prompts-v2.jsonl",
        [*lines[:3], {"id": "new", "prompt": "A new one", "max_tokens": 6}],
    )
    env = s3_env(workspace, s3_endpoint)
    out = run_sh(doc_block("cache"), workspace, env)
    text = out.stdout
    stats = json.JSONDecoder().raw_decode(text[text.index('{"uri"') :])[0]
    assert (stats["hits"], stats["misses"], stats["entries"]) == (3, 5, 5)
    assert stats["uri"] == "s3://bucket/batchgen-cache"

    def result(job: str) -> dict[str, list]:
        return pq.read_table(f"bucket/out/{job}/result.parquet", filesystem=store).to_pydict()

    v1, v2 = result("v1"), result("v2")
    assert v1["cached"] == [False] * 4
    assert v2["cached"] == [True, True, True, False]
    assert v2["token_ids"][:3] == v1["token_ids"][:3]
    manifest = json.loads(store.open_input_stream("bucket/out/v1/manifest.json").read())
    v1_job = manifest["job"]["job_id"]
    assert v2["cache_source"] == [v1_job] * 3 + [None]
    # `cache clear` left nothing
    after = subprocess.run(["batchgen", "cache", "stats", "--json"], cwd=workspace,
                           env={**env, "BATCHGEN_CACHE": "s3://bucket/batchgen-cache"},
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(after.stdout)["entries"] == 0


def test_the_retry_block(workspace: Path):
    lines = [{"id": f"r{i}", "prompt": "word " * (4 if i % 2 else 60), "max_tokens": 8}
             for i in range(4)]  # fmt: skip
    jsonl(workspace / "prompts.jsonl", lines)
    env = shell_env(workspace / "home", JOB="docs-retry")
    # a first pass on a KV pool too small for the long prompts: they become error rows
    for command in (["submit", "prompts.jsonl", "--model", "./tiny", "--job-id", "docs-retry"],
                    ["worker", "--model", "./tiny", "--burst", "--device", "cpu",
                     "--num-kv-blocks", "4"],
                    ["download", "docs-retry", "-o", "first.parquet"]):  # fmt: skip
        first = subprocess.run(["batchgen", *command], cwd=workspace, env=env,
                               capture_output=True, text=True)  # fmt: skip
        assert first.returncode == 0, first.stderr
    before = pq.read_table(workspace / "first.parquet").to_pydict()
    assert [r == "error" for r in before["finish_reason"]] == [True, False, True, False]

    out = run_sh(doc_block("retry"), workspace, env)
    assert "state      completed" in out.stdout
    assert "retried    2 rows in 1 retry round(s)" in out.stdout
    subprocess.run(["batchgen", "download", "docs-retry", "-o", "after.parquet"], cwd=workspace,
                   env=env, check=True, capture_output=True)  # fmt: skip
    after = pq.read_table(workspace / "after.parquet").to_pydict()
    assert after["id"] == before["id"]
    assert "error" not in after["finish_reason"]
    for i in (1, 3):  # the rows that were fine stay exactly as they were
        assert {k: after[k][i] for k in after} == {k: before[k][i] for k in before}


def test_the_serve_blocks(workspace: Path, capsys, monkeypatch):
    port = free_port()
    env = shell_env(workspace / "home")

    def live_workers() -> list:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/workers",
                                         headers={"Authorization": "Bearer sk-my-key"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                return json.loads(reply.read())
        except (urllib.error.URLError, OSError):
            return []

    procs = start_sh(doc_block("serve"), workspace, env, workspace / "serve.log",
                     {"--port 8000": f"--port {port}"})  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not live_workers():
            assert procs.poll() in (None, 0), (workspace / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (workspace / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        model = str(workspace / "tiny")  # as the worker names it: the path made absolute
        code = replaced(doc_block("serve-client").text, {
            "http://localhost:8000/v1": f"http://localhost:{port}/v1",
            "time.sleep(5)": "time.sleep(0.3)",
        })  # fmt: skip
        monkeypatch.chdir(workspace)
        # a model no worker serves, as the page warns: the client prints why, no crash
        jsonl(workspace / "requests.jsonl", [
            {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}]}}])  # fmt: skip
        exec(compile(code, "docs/serve.md", "exec"), {})
        assert capsys.readouterr().out == (
            "failed BatchRequestCounts(completed=0, failed=0, total=0)\n"
            "model_not_found: no live worker serves the model 'gpt-4o-mini' (start one: "
            "batchgen worker --model MODEL)\n"
        )
        jsonl(workspace / "requests.jsonl", [
            {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "messages": [{"role": "user", "content": f"Hi {i}"}],
                      "max_tokens": 5}} for i in range(4)])  # fmt: skip
        exec(compile(code, "docs/serve.md", "exec"), {})
    finally:
        stop(procs)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "completed BatchRequestCounts(completed=4, failed=0, total=4)"
    printed = [json.loads(line) for line in out[1:] if line]
    assert sorted(line["custom_id"] for line in printed) == [f"doc-{i}" for i in range(4)]
    assert {line["response"]["status_code"] for line in printed} == {200}


def test_the_keys_file_block(workspace: Path):
    """Two keys of one tenant share its files, another tenant's key sees none, the admin all."""
    import openai

    port = free_port()
    procs = start_sh(doc_block("keys-file"), workspace, shell_env(workspace / "home"),
                     workspace / "keys.log", {"--port 8000": f"--port {port}"})  # fmt: skip

    def as_key(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                as_key("sk-bob").files.list()
                break
            except openai.APIConnectionError:
                assert procs.poll() in (None, 0), (workspace / "keys.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (workspace / "keys.log").read_text()[-3000:]
                time.sleep(0.5)
        mine = as_key("sk-alice-1").files.create(file=("r.jsonl", b"{}\n"), purpose="batch")
        assert [f.id for f in as_key("sk-alice-2").files.list()] == [mine.id]
        assert [f.id for f in as_key("sk-bob").files.list()] == []
        with pytest.raises(openai.NotFoundError):
            as_key("sk-bob").files.content(mine.id)
        assert as_key("sk-ops").files.retrieve(mine.id).id == mine.id
    finally:
        stop(procs)


def test_the_structured_output_examples_do_what_the_page_says(workspace: Path):
    """Run with the toy checkpoint: every line but json_object's ends with stop and holds
    what its constraint allows; json_object's runs to its max_tokens, as the page warns."""
    import jsonschema

    (workspace / "structured.jsonl").write_text(doc_block("structured-lines").text)
    env = shell_env(workspace / "home")
    subprocess.run(["batchgen", "run", "structured.jsonl", "--model", "./tiny", "-o",
                    "structured.parquet"], cwd=workspace, env=env, check=True,
                   capture_output=True)  # fmt: skip
    got = pq.read_table(workspace / "structured.parquet").to_pydict()
    lines = [json.loads(line) for line in doc_block("structured-lines").text.splitlines()]
    reasons = got["finish_reason"]
    assert reasons == ["stop", "length", "stop", "stop", "stop", "stop"]
    label = lines[0]["structured_output"]["json"]
    assert label["additionalProperties"] is False
    jsonschema.validate(json.loads(got["text"][0]), label)
    openai_schema = lines[5]["body"]["response_format"]["json_schema"]["schema"]
    jsonschema.validate(json.loads(got["text"][5]), openai_schema)
    assert got["completion_tokens"][1] == lines[1]["max_tokens"]
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", got["text"][2])
    assert got["text"][3] in ("yes", "no")
    assert re.fullmatch(r"(hello|hi) [a-z]{1,12}", got["text"][4])


def test_the_python_api_block(workspace: Path, monkeypatch):
    monkeypatch.chdir(workspace)
    names: dict = {}
    exec(compile(doc_block("python-api").text, "docs/python-api.md", "exec"), names)
    outs, vectors = names["outs"], names["vectors"]
    assert len(outs) == 3
    for out in outs:
        assert (out.finish_reason, len(out.token_ids)) == ("length", 32) or (
            out.finish_reason == "stop" and len(out.token_ids) < 32
        )
    assert [len(v) for v in vectors] == [256, 256]  # the toy's hidden size
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)
    stats = names["engine"].stats()
    assert stats.num_steps > 0 and stats.generation_tokens == sum(len(o.token_ids) for o in outs)


def test_the_gpu_install_block_installs_that_torch(tmp_path: Path):
    """It needs the network: `make -n` shows what it would run, in a clone without a venv."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    text = replaced(doc_block("install-gpu").text, {"make setup": "make -n setup"})
    dry = subprocess.run(["bash", "-e", "-c", text], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert "-m venv .venv" in dry
    assert ("pip install --progress-bar on torch==2.13.0 --index-url "
            "https://download.pytorch.org/whl/cu128") in dry  # fmt: skip
    assert "pip install --progress-bar on -e '.[dev]'" in dry


def test_a_fresh_setup_says_where_the_user_waits_and_pip_is_never_silent(tmp_path: Path):
    """What install.md says of a fresh clone: make names the wait and its four steps before
    each, and no pip runs quiet (the timing itself is measured there, by hand)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    dry = subprocess.run(["make", "-n", "demo"], cwd=tmp_path, capture_output=True, text=True,
                         env=shell_env(tmp_path / "home"), check=True).stdout.splitlines()  # fmt: skip
    said = [line.split('"')[1] for line in dry if line.startswith('echo "make: ')]
    assert said == [
        "make: installing torch and batchgen's packages into .venv: the one slow step,",
        "make: several minutes on a fresh clone, skipped once done (pip shows its progress)",
        "make: [1/4] a virtualenv in .venv", "make: [2/4] pip itself",
        "make: [3/4] torch (torch==2.13.0), the largest download",
        "make: [4/4] batchgen and its packages",
    ]  # fmt: skip
    pips = [line for line in dry if " -m pip " in line]
    assert len(pips) == 3 and not any(" -q" in line for line in pips)
    assert dry.index(next(line for line in dry if "[3/4]" in line)) < dry.index(pips[1])
    assert dry[-1] == ".venv/bin/python scripts/demo.py"
    # the demo installs batchgen alone; the test tools (the dev extra) wait for make test
    assert pips[2] == ".venv/bin/python -m pip install --progress-bar on -e ."
    tests = subprocess.run(["make", "-n", "pytest"], cwd=tmp_path, capture_output=True,
                           text=True, env=shell_env(tmp_path / "home"), check=True).stdout  # fmt: skip
    assert tests.count(" -m pip install ") == 4
    assert ".venv/bin/python -m pip install --progress-bar on -e '.[dev]'\n" in tests


def test_the_compose_block_matches_the_compose_file(tmp_path: Path):
    """No Docker engine here: the block's names are checked against docker-compose.yml, its
    own commands run, and its submit parses with the real CLI."""
    from batchgen.cli import main

    lines = doc_block("compose").text.splitlines()
    compose_text = (REPO / "docker-compose.yml").read_text()
    compose = yaml.safe_load(compose_text)
    # the variables it sets are the ones compose reads
    set_here = set(re.findall(r"\b([A-Z_]+)=", "\n".join(lines[:2])))
    assert set_here == {"REDIS_PASSWORD", "OUTPUT_DIR", "MODEL_DIR"}
    for name in ("REDIS_PASSWORD", "OUTPUT_DIR"):
        assert "${" + name + ":?" in compose_text  # compose refuses to start without them
    assert "${MODEL_DIR:-" in compose_text
    # the password it makes can go into a URL as it is (letters and digits)
    password = subprocess.run(["bash", "-e", "-c", lines[0] + "\necho $REDIS_PASSWORD"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert re.fullmatch(r"[0-9a-f]{64}", password)
    # the host reaches Redis where compose publishes it, and names the model as the worker does
    assert "127.0.0.1:6379:6379" in compose["services"]["redis"]["ports"]
    assert "@127.0.0.1:6379/0" in lines[2]
    worker = [str(part) for part in compose["services"]["worker"]["command"]]
    model = worker[worker.index("--model") + 1]
    volumes = compose["services"]["worker"]["volumes"]
    assert f"--model {model} " in lines[3] and volumes[0].endswith(f":{model}:ro")
    assert volumes[1].endswith("}:${OUTPUT_DIR}")  # the same path inside as on the host
    # the submit line is one the CLI takes
    argv = shlex.split(lines[3].replace("$OUTPUT_DIR", "/srv/batchgen/outputs"))
    assert argv[0] == "batchgen"
    command = main.get_command(click.Context(main), argv[1])
    assert command is not None
    command.make_context(argv[1], argv[2:])  # raises on a flag submit lacks
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=REPO)
    assert ignored.returncode == 0, ".env must be git-ignored"


BENCHMARK_BLOCKS = ["bench-engine", "bench-embed", "bench-pipeline", "bench-cache",
                    "bench-tables", "bench-serve", "gpu-check", "soak", "bench-moe", "bench-backend",
                    "bench-fair-share", "bench-prefix-affinity", "serve-storm",
                    "bench-scheduler-scale"]  # fmt: skip
PARSE_ONLY = """
import argparse, json, runpy, sys
class Parsed(Exception):
    pass
real = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    raise Parsed(vars(real(self, args, namespace)))
argparse.ArgumentParser.parse_args = parse_args
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv = argv[1:] if argv[0] == "-m" else argv
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = argv[0].rsplit("/", 1)[0]
            runpy.run_path(argv[0], run_name="__main__")
        results.append("ran without parsing arguments")
    except Parsed:
        results.append("parsed")
    except SystemExit as exc:
        results.append(f"exit {exc.code}")
print(json.dumps(results))
"""


def test_the_benchmark_commands_parse_as_written():
    """A benchmark takes minutes (or a GPU): each command's arguments go through the script's
    own parser, which stops it right there."""
    commands = []
    for name in BENCHMARK_BLOCKS:
        for line in doc_block(name).text.splitlines():
            argv = shlex.split(line, comments=True)
            assert argv[0] == "python", line
            commands.append(argv[1:])
    out = subprocess.run([sys.executable, "-c", PARSE_ONLY, json.dumps(commands)], cwd=REPO,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert dict(zip(map(" ".join, commands), results)) == {" ".join(c): "parsed" for c in commands}
