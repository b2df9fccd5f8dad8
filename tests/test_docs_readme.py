"""The README's command blocks, run as written: a newcomer's session from `make demo` to
their own model, and the fleet in five lines against a password-protected Redis and S3."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis
import torch

from batchgen.jobs.redis import embedded
from tests.doc_blocks import REPO, doc_block, run_sh, shell_env, start_sh, stop
from tests.hf_reference import first_divergence_is_tie, hf_greedy

BARE_PATH = os.pathsep.join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if Path(p).is_dir())


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """The embedded Redis's home for the blocks that use it, stopped afterwards."""
    path = tmp_path / "home"
    yield path
    if (path / "redis").exists():
        embedded.stop(path)


def clone_for_make(tmp_path: Path, toy: Path) -> Path:
    """What `make demo` needs of a clone, beside the venv this test runs in: the Makefile,
    pyproject.toml (older than the install stamp, so make installs nothing), the demo
    script, and the demo's checkpoint already written (the one `batchgen toy-model`
    writes: same seed, same bytes, tests/test_toy_model.py)."""
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml", "scripts/demo.py"):
        shutil.copy(REPO / name, clone / name)
    os.utime(clone / "pyproject.toml", (0, 0))
    venv = clone / ".venv"
    venv.mkdir()
    stamps = (".runtime-stamp", ".installed-stamp")
    for entry in Path(sys.prefix).iterdir():
        if entry.name not in stamps:
            (venv / entry.name).symlink_to(entry)
    for stamp in stamps:
        (venv / stamp).touch()
    (clone / "demo").mkdir()
    (clone / "demo" / "tiny").symlink_to(toy)
    return clone


def own_checkpoint(path: Path, tokenizer_from: Path) -> Path:
    """A checkpoint as transformers writes it, not batchgen: a small random Llama."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.3,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def rows(path: Path) -> dict[str, list]:
    return pq.read_table(path).to_pydict()


def assert_lengths(got: dict[str, list], limits: list[int]) -> None:
    """Each row ran to its max_tokens, or stopped at EOS before it."""
    for reason, tokens, limit in zip(got["finish_reason"], got["token_ids"], limits):
        assert (reason, len(tokens)) == ("length", limit) or (
            reason == "stop" and len(tokens) < limit
        )


@pytest.mark.skipif(
    not (Path(sys.prefix) / "bin" / "activate").exists() or shutil.which("make") is None,
    reason="needs make and a venv to activate",
)
def test_a_newcomers_session_from_make_demo_to_their_own_model(tmp_path, toy_model, home):
    toy = toy_model("llama")
    clone = clone_for_make(tmp_path, toy)
    bare = shell_env(home, PATH=BARE_PATH)
    dry = subprocess.run(["make", "-n", "demo"], cwd=clone, env=bare, capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert dry.stdout == ".venv/bin/python scripts/demo.py\n"  # nothing to install
    assert subprocess.run(["bash", "-c", "command -v batchgen"], env=bare).returncode == 1

    out = run_sh(doc_block("install"), clone, bare)
    import batchgen

    assert out.stdout.splitlines()[-1] == f"batchgen, version {batchgen.__version__}"
    assert "wrote " in out.stdout and "(26 rows, one per input line, input order)" in out.stdout

    shell = shell_env(home)  # the activated venv: its bin first on PATH
    out = run_sh(doc_block("first-job"), clone, shell)
    first = rows(clone / "answers.parquet")
    assert first["id"] == ["sea", "redis", "r3"] and first["index"] == [0, 1, 2]
    # the line's max_tokens; the chat line without one runs to its end, past 16 tokens
    assert_lengths(first, [32, 4096 - first["prompt_tokens"][1], 16])
    assert len(first["token_ids"][1]) > 16
    assert "sea" in out.stdout and "finish_reason" in out.stdout

    run_sh(doc_block("workers"), clone, shell)
    again = rows(clone / "fleet.parquet")
    assert again["id"] == first["id"]
    assert_lengths(again, [32, 64, 16])  # --max-tokens 64 for the line without its own
    # greedy rows are the same tokens; the seeded one makes the same draws, 64 of them
    assert again["token_ids"][0] == first["token_ids"][0]
    assert again["token_ids"][2] == first["token_ids"][2]
    assert first["token_ids"][1][: len(again["token_ids"][1])] == again["token_ids"][1]

    model = own_checkpoint(clone / "my-model", toy)
    run_sh(doc_block("own-model"), clone, shell)
    own = rows(clone / "mine.parquet")
    assert own["id"] == ["sea", "redis", "r3"]
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model).encode("Write a haiku about the sea")
    ref = hf_greedy(model, prompt, 32, stop_at_eos=True)
    got = own["token_ids"][0]
    assert got == ref or first_divergence_is_tie(model, prompt, ref, got)


def test_the_test_command_is_what_ci_runs():
    """`make test` is the suite itself: it runs as `make -n`, which names what it runs."""
    block = doc_block("develop")
    assert block.text.splitlines()[0].split("#")[0].strip() == "make test"
    dry = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    for step in ("ruff check .", "ruff format --check .", "scripts/typecheck.py", "-m pytest"):
        assert step in dry, step
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("\nmake test")


def test_a_fleet_in_five_lines(tmp_path, private_redis, s3_endpoint, toy_model):
    password = "docs" + os.urandom(8).hex()
    redis.Redis.from_url(private_redis.url).config_set("requirepass", password)
    host = f"127.0.0.1:{private_redis.port}"
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "prompt": f"Fleet question {i}", "max_tokens": 8}) + "\n"
        for i in range(6)))  # fmt: skip
    env = shell_env(
        tmp_path / "home", REDIS_PASSWORD=password, REDIS_HOST=host, MODEL=str(toy_model("llama")),
        BUCKET="batchgen-test", AWS_ENDPOINT_URL=f"http://{s3_endpoint}",
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
    )  # fmt: skip
    worker_block, replace = doc_block("fleet-worker"), {}
    if not torch.cuda.is_available():
        # as written, it says what is wrong; then the same line on the CPU
        out = subprocess.run(["bash", "-e", "-c", worker_block.text], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert "--gpus: no CUDA device is visible on this machine" in out.stderr
        assert "Traceback" not in out.stderr
        replace = {"--gpus all": "--device cpu"}
    worker = start_sh(worker_block, tmp_path, env, tmp_path / "worker.log", replace)
    try:
        url = f"redis://:{password}@{host}/0"
        run_sh(doc_block("fleet-client"), tmp_path, {**env, "BATCHGEN_REDIS_URL": url})
    finally:
        stop(worker)
    got = rows(tmp_path / "answers.parquet")
    assert got["id"] == [f"q{i}" for i in range(6)]
    assert_lengths(got, [8] * 6)
    import pyarrow.fs as pafs

    store = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http")
    names = {info.base_name for info in store.get_file_info(
        pafs.FileSelector("batchgen-test/jobs/first", recursive=True)) if info.is_file}  # fmt: skip
    assert {"result.parquet", "manifest.json"} <= names
