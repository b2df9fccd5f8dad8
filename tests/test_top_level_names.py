"""No process batchgen starts, and no test or benchmark command the docs give, imports a
folder of the checkout in place of an installed package of the same name.

``worker/``, ``kernels/`` and ``jobs/`` stand at the top of the repository; they are
``batchgen.worker`` and so on, never packages of their own (batchgen/parts.py). Hugging
Face's ``kernels`` package, which transformers (5.25 and newer) imports, is the case
that broke: with the checkout's root first on ``sys.path`` (``python -m`` run from the
root, pytest's rootdir) ``import kernels`` found the repository's folder and every
model load failed. Each check runs from the repository's root and from the parent of
a clone named ``batchgen`` (where the clone itself could pass for the package).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.parts import PARTS

REPO = Path(__file__).resolve().parents[1]
WHERE = ("root", "parent")
BIN = Path(sys.executable).parent


def hf_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def is_checkout_package(name: str) -> bool:
    """Whether ``import name`` would load the checkout's folder of that name as a package."""
    spec = importlib.util.find_spec(name)
    return bool(spec and spec.origin and Path(spec.origin).resolve().is_relative_to(REPO / name))


def test_no_top_level_name_is_a_package_of_the_checkout():
    # the hazard is real here: pytest put the checkout's root on sys.path
    assert REPO in [Path(entry or ".").resolve() for entry in sys.path]
    assert [name for name in PARTS if is_checkout_package(name)] == []
    for name in PARTS:
        assert not (REPO / name / "__init__.py").exists(), name


def test_transformers_imports_hugging_faces_kernels():
    """The import that failed: transformers' hub kernels, which import ``kernels``."""
    if not hf_kernels_installed():
        pytest.skip("Hugging Face's kernels package is not installed (transformers>=5.25 "
                    "installs it): nothing named kernels to find")  # fmt: skip
    from transformers.integrations import hub_kernels

    import kernels

    assert hub_kernels.is_kernels_available()
    assert Path(kernels.__file__).resolve().parent.parent.name == "site-packages"


@pytest.fixture(scope="module")
def clone_parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the checkout under the name ``batchgen`` (a link to it)."""
    parent = tmp_path_factory.mktemp("clones")
    (parent / "batchgen").symlink_to(REPO, target_is_directory=True)
    return parent


def cwd_and_repo(where: str, clone_parent: Path) -> tuple[Path, str]:
    """The working directory, and the repository's path as a command there names it."""
    return (REPO, ".") if where == "root" else (clone_parent, "batchgen")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what ties a process to this pytest run's workers."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "BATCHGEN_"))}  # fmt: skip
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


@pytest.mark.parametrize("where", WHERE)
def test_a_regular_package_of_the_name_wins_over_the_folder(where, clone_parent, tmp_path):
    """Any installed package named like a part is what ``import`` finds, even with the
    checkout first on the path (``python -c`` there, ``python -m benchmarks.X``)."""
    installed = tmp_path / "site"
    for name in PARTS:
        (installed / name).mkdir(parents=True)
        (installed / name / "__init__.py").write_text("WHO = 'installed'\n")
    code = "import kernels, jobs, worker; print(kernels.WHO, jobs.WHO, worker.WHO)"
    cwd, _ = cwd_and_repo(where, clone_parent)
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                         env=clean_env(PYTHONPATH=str(installed)))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["installed"] * 3


@pytest.mark.parametrize("where", WHERE)
def test_pytest_as_the_docs_run_it(where, clone_parent):
    """``python -m pytest FILE`` (README), run on this file's two in-process checks."""
    cwd, repo = cwd_and_repo(where, clone_parent)
    tests = [f"{repo}/tests/test_top_level_names.py::{name}" for name in (
        "test_no_top_level_name_is_a_package_of_the_checkout",
        "test_transformers_imports_hugging_faces_kernels")]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", *tests], cwd=cwd, capture_output=True, text=True,
                         env=clean_env(), timeout=300)  # fmt: skip
    expected = "2 passed" if hf_kernels_installed() else "1 passed, 1 skipped"
    assert out.returncode == 0, out.stdout[-3000:]
    assert f"{expected} in" in out.stdout


@pytest.mark.parametrize("where", WHERE)
def test_benchmark_as_the_docs_run_it(where, clone_parent, toy_model):
    """A benchmark that loads a model, as docs/benchmarks.md runs it (from the parent
    by path; ``python -m benchmarks.X`` finds the package only from the root)."""
    cwd, repo = cwd_and_repo(where, clone_parent)
    if where == "root":
        command = [sys.executable, "-m", "benchmarks.engine_profile"]
    else:
        command = [sys.executable, f"{repo}/benchmarks/engine_profile.py"]
    out = subprocess.run([*command, "--model", str(toy_model("llama")), "--num-requests", "2"],
                         cwd=cwd, capture_output=True, text=True, env=clean_env(),
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert report["requests"] == 2


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.kill()


@pytest.fixture(scope="module")
def cluttered_parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone's parent that also holds modules named like batchgen's dependencies,
    which no process batchgen starts may import (they run ``python -P``)."""
    parent = tmp_path_factory.mktemp("cluttered")
    (parent / "batchgen").symlink_to(REPO, target_is_directory=True)
    for name in ("redis", "torch", "transformers"):
        (parent / f"{name}.py").write_text(
            f'raise ImportError("the working directory\'s {name}.py")\n'
        )
    return parent


@pytest.mark.parametrize("where", WHERE)
def test_worker_and_finalizer_from_anywhere(
    where, cluttered_parent, redis_url, toy_model, tmp_path
):
    """The real ``batchgen worker`` (a supervisor, its engine process and a finalizer
    process), started where a user might start it, serves a job to its final file."""
    cwd, _ = cwd_and_repo(where, cluttered_parent)
    model = str(toy_model("llama"))
    env = clean_env(BATCHGEN_REDIS_URL=redis_url, BATCHGEN_HOME=str(tmp_path / "home"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"line {i}"}) + "\n"
                               for i in range(3)))  # fmt: skip
    job = subprocess.run([BIN / "batchgen", "submit", str(prompts), "--model", model,
                          "--max-tokens", "4", "--output", str(tmp_path / "out")], cwd=cwd,
                         env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    log = tmp_path / "worker.log"
    with open(log, "wb") as sink:
        worker = subprocess.Popen([BIN / "batchgen", "worker", "--model", model, "--device",
                                   "cpu", "--burst", "--claim-timeout", "5"], cwd=cwd, env=env,
                                  stdout=sink, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:
        rc = worker.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        pytest.fail(f"the worker did not finish the job: {log.read_text()[-4000:]}")
    assert rc == 0, log.read_text()[-4000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
    table = pq.read_table(tmp_path / "out" / "result.parquet").to_pydict()
    assert table["id"] == ["p0", "p1", "p2"], job
    assert table["finish_reason"] == ["length"] * 3
