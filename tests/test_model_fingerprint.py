"""The model fingerprint hashes what decides the tokens, weights included, is
remembered per weight file, and a worker holding other weights refuses the job.

Two checkpoints here differ only in one weight value: same config, same
tokenizer, same safetensors header (same names, dtypes, shapes, offsets).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from batchgen.jobs.ops import modelinfo
from batchgen.jobs.ops.job_record import load_job
from tests.test_pipeline_e2e import KEYS, batchgen, download, submit, wait_for, write_jsonl
from tests.test_pipeline_e2e import env as env  # fixtures
from tests.test_pipeline_e2e import workers as workers

WEIGHTS = "model.safetensors"


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return f.read(size)


@pytest.fixture(scope="module")
def checkpoints(toy_model, tmp_path_factory) -> tuple[Path, Path]:
    """(a, b): b is a copy of a with one float of one tensor changed."""
    a = toy_model("llama")
    b = tmp_path_factory.mktemp("fingerprint") / "b"
    shutil.copytree(a, b)
    data = bytearray((b / WEIGHTS).read_bytes())
    offset = 8 + int.from_bytes(data[:8], "little") + 64  # inside the first tensor's data
    data[offset] ^= 0x01
    (b / WEIGHTS).write_bytes(bytes(data))
    assert _header(a / WEIGHTS) == _header(b / WEIGHTS)
    return a, b


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_checkpoints_that_differ_only_in_weights_differ_in_fingerprint(checkpoints, home, tmp_path):
    a, b = checkpoints
    fa, fb = modelinfo.fingerprint(str(a)), modelinfo.fingerprint(str(b))
    assert fa.startswith("sha256:") and fb.startswith("sha256:") and fa != fb
    moved = tmp_path / "moved"
    shutil.copytree(a, moved)
    assert modelinfo.fingerprint(str(moved)) == fa  # the content, not the path
    for name in ("generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        edited = tmp_path / f"edited-{name}"
        shutil.copytree(a, edited)
        (edited / name).write_text((edited / name).read_text().replace("}", ' , "x": 1}', 1))
        assert modelinfo.fingerprint(str(edited)) not in (fa, fb), name
    assert modelinfo.fingerprint("org/some-hf-id") == ""


def test_a_weight_digest_is_remembered_until_the_file_changes(checkpoints, home, tmp_path):
    weights = tmp_path / WEIGHTS
    shutil.copy(checkpoints[0] / WEIGHTS, weights)
    true_digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert modelinfo.weights_sha256(weights) == true_digest
    memo = modelinfo.memo_slot(weights.resolve()).with_suffix(".json")
    stored = json.loads(memo.read_text())
    st = weights.stat()
    assert stored["sha256"] == true_digest
    assert stored["identity"] == {
        "path": str(weights.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "device": st.st_dev,
    }  # fmt: skip

    # unchanged file: the memo is trusted, the file is not read again
    memo.write_text(json.dumps({**stored, "sha256": "f" * 64}))
    assert modelinfo.weights_sha256(weights) == "f" * 64

    # rewritten in place, same size, mtime put back: its ctime gives it away
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert modelinfo.weights_sha256(weights) == hashlib.sha256(bytes(data)).hexdigest()


def test_workers_starting_at_once_hash_a_file_once(checkpoints, home):
    """Both wait on the file's lock (held here); then one hashes, the other reads the memo."""
    model = checkpoints[0]
    lock = modelinfo.memo_slot((model / WEIGHTS).resolve()).with_suffix(".lock")
    lock.parent.mkdir(parents=True)
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
        "from batchgen.jobs.ops.modelinfo import fingerprint; print(fingerprint(sys.argv[1]))"
    )
    env = {**os.environ, "BATCHGEN_HOME": str(home)}
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        args = [sys.executable, "-c", code, str(model)]
        pipe = subprocess.PIPE
        procs = [
            subprocess.Popen(args, env=env, text=True, stdout=pipe, stderr=pipe) for _ in range(2)
        ]
        time.sleep(3)
        assert [p.poll() for p in procs] == [None, None]  # both wait for the lock
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0][0] == outs[1][0] == modelinfo.fingerprint(str(model)) + "\n"
    hashing = [line for _, err in outs for line in err.splitlines() if "hashing" in line]
    assert len(hashing) == 1, hashing


@pytest.mark.slow
def test_a_worker_holding_other_weights_refuses_the_job(checkpoints, workers, env, home, tmp_path):
    a, b = checkpoints
    model = tmp_path / "model"  # one path; the weights under it change
    shutil.copytree(a, model)
    lines = [
        {"id": f"r{i}", "prompt": f"Tell me about item {i}.", "max_tokens": 6} for i in range(4)
    ]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    submit(env, model, path, "fp", tmp_path)
    conn = redis.Redis.from_url(env["BATCHGEN_REDIS_URL"])
    submitted_for = load_job(conn, KEYS, "fp").model_fingerprint
    assert submitted_for == modelinfo.fingerprint(str(a)) != ""

    shutil.copy(b / WEIGHTS, model / WEIGHTS)  # another host's copy, or a retrained file
    again = batchgen(env, "submit", str(path), "--model", str(model), "--job-id", "fp",
                     "--output", str(tmp_path / "out-fp"))  # fmt: skip
    assert again.returncode != 0 and "was submitted for other weights" in again.stderr

    stale = workers(model)
    wait_for(lambda: load_job(conn, KEYS, "fp").refused != "", 180, "the worker to refuse")
    time.sleep(2)  # it keeps refusing: nothing runs
    record = load_job(conn, KEYS, "fp")
    # running since the worker read its first request (dispatch says so), though it refuses
    assert (record.done, record.failed, record.state.value) == (0, 0, "running")
    assert f"the job was submitted for {submitted_for}" in record.refused
    status = batchgen(env, "status", "fp")
    assert "refused    worker" in status.stdout
    os.killpg(stale.pid, signal.SIGTERM)
    assert stale.wait(timeout=60) == 0

    shutil.copy(a / WEIGHTS, model / WEIGHTS)
    good = workers(model, "--burst")
    assert good.wait(timeout=300) == 0, (tmp_path / "worker-1.log").read_text()[-3000:]
    rows = download(env, "fp", tmp_path)
    assert rows["id"] == [line["id"] for line in lines]
    assert rows["finish_reason"] == ["length"] * 4
    assert rows["attempts"] == [1] * 4  # the refusals were not charged

    from batchgen import Engine, SamplingParams

    engine = Engine.from_pretrained(a, device="cpu")
    outs = engine.generate([str(line["prompt"]) for line in lines], SamplingParams(max_tokens=6))
    assert rows["token_ids"] == [list(o.token_ids) for o in outs]
    manifest = json.loads((tmp_path / "out-fp" / "manifest.json").read_text())
    assert manifest["model"]["fingerprint"] == submitted_for
