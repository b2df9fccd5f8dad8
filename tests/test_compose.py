"""docker-compose.yml: a durable, private Redis, a GPU worker, and commands the CLI has.

No Docker engine runs here, so the file is checked as data: every batchgen
command it runs must parse with the real CLI's options. The Redis service's
own shell command and health check do run, with a real redis-server and
redis-cli, behind a stand-in for the image's entrypoint.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import click
import pytest
import redis
import yaml

from batchgen.cli import main
from batchgen.jobs.redis.redis_server import find_redis_server, free_port

REPO = Path(__file__).resolve().parents[1]
REQUIRED = re.compile(r"\$\{REDIS_PASSWORD:\?[^}]+\}")  # compose refuses to start without it


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    """What compose makes of a value: ``$$`` is a literal ``$``, ``${NAME:?msg}`` NAME's value."""
    out = re.sub(r"\$\$|\$\{(\w+):\?[^}]*\}", lambda m: env[m[1]] if m[1] else "$", value)
    assert "${" not in out, f"an unexpected interpolation in {value!r}"
    return out


def _entrypoint() -> list[str]:
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT"):
            return yaml.safe_load(line.removeprefix("ENTRYPOINT").strip())
    raise AssertionError("Dockerfile has no ENTRYPOINT")


def test_redis_is_durable_and_never_evicts():
    redis = _compose()["services"]["redis"]
    command = [str(part) for part in redis["command"]]
    assert command[:2] == ["sh", "-c"] and command[3] == "redis-server"  # $0
    flags = dict(zip(command[4::2], command[5::2]))
    assert flags == {
        "--appendonly": "yes",
        "--appendfsync": "everysec",
        "--maxmemory-policy": "noeviction",
    }
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-data" in _compose()["volumes"]


def test_outputs_are_a_host_directory_at_the_same_path_in_the_worker():
    """submit, download and delete run on the host and claim, read and remove the job's
    files there; a named volume would hide them from the host."""
    (mount,) = [v for v in _compose()["services"]["worker"]["volumes"] if "OUTPUT_DIR" in v]
    host, container = mount.split("}:", 1)
    assert host.startswith("${OUTPUT_DIR:?") and container == "${OUTPUT_DIR}"
    assert set(_compose()["volumes"]) == {"redis-data"}


def test_worker_reserves_gpus_and_builds_from_the_repo():
    worker = _compose()["services"]["worker"]
    assert worker["build"] == "."
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == "all"
    assert (REPO / "Dockerfile").is_file()


def test_every_batchgen_command_in_compose_parses_with_the_real_cli():
    assert _entrypoint() == ["batchgen"]
    commands = []
    for name, service in _compose()["services"].items():
        if service.get("build") == "." and "command" in service:
            commands.append((name, [str(part) for part in service["command"]]))
    assert commands, "no batchgen service in docker-compose.yml"
    for name, args in commands:
        ctx = click.Context(main, info_name="batchgen")
        sub = main.get_command(ctx, args[0])
        assert sub is not None, f"service {name}: batchgen has no command {args[0]!r}"
        try:
            sub.make_context(args[0], args[1:], parent=ctx)
        except click.UsageError as exc:  # unknown option, missing value, bad choice
            raise AssertionError(f"service {name}: {' '.join(args)}: {exc}") from exc


def test_a_wrong_flag_would_be_caught():
    ctx = click.Context(main, info_name="batchgen")
    worker = main.get_command(ctx, "worker")
    assert worker is not None
    try:
        worker.make_context("worker", ["--model", "m", "--gpu", "all"], parent=ctx)
    except click.UsageError as exc:
        assert "No such option '--gpu'" in str(exc)
    else:
        raise AssertionError("a misspelt flag parsed")


def test_redis_needs_a_password_given_by_environment_with_no_default():
    compose = _compose()
    redis_env = compose["services"]["redis"]["environment"]
    assert set(redis_env) == {"REDIS_PASSWORD"}
    assert REQUIRED.fullmatch(redis_env["REDIS_PASSWORD"])
    text = (REPO / "docker-compose.yml").read_text()
    assert ":-" not in "".join(re.findall(r"\$\{REDIS_PASSWORD[^}]*\}", text))  # no default
    assert "requirepass" in compose["services"]["redis"]["command"][2]


def test_redis_is_published_to_this_host_only():
    assert _compose()["services"]["redis"]["ports"] == ["127.0.0.1:6379:6379"]


def test_the_worker_gets_the_redis_url_by_environment_not_its_command_line():
    worker = _compose()["services"]["worker"]
    url = worker["environment"]["BATCHGEN_REDIS_URL"]
    assert url.startswith("redis://:${REDIS_PASSWORD:?") and url.endswith("}@redis:6379/0")
    assert REQUIRED.search(url)
    assert not any("redis" in str(part) for part in worker["command"])


@pytest.fixture
def image_bin(tmp_path: Path) -> Path:
    """A PATH like the redis image's: redis-server, redis-cli, and docker-entrypoint.sh (here a
    stand-in that runs its arguments, as the real one does after dropping to the redis user)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    server = Path(find_redis_server())
    cli = server.with_name("redis-cli")
    if not cli.exists():
        pytest.skip(f"no redis-cli beside {server} to run the health check with")
    (bin_dir / "redis-server").symlink_to(server)
    (bin_dir / "redis-cli").symlink_to(cli)
    entrypoint = bin_dir / "docker-entrypoint.sh"
    entrypoint.write_text('#!/bin/sh\nexec "$@"\n')
    entrypoint.chmod(0o755)
    return bin_dir


def test_the_redis_service_command_really_requires_the_password(image_bin, tmp_path):
    """Compose's own command, run: the password works, no password is refused, and the
    password is on no command line; the health check passes only with it."""
    password = secrets.token_hex(32)
    service = _compose()["services"]["redis"]
    env = {**os.environ, "PATH": f"{image_bin}{os.pathsep}{os.environ['PATH']}"}
    env |= {
        k: interpolate(v, {"REDIS_PASSWORD": password}) for k, v in service["environment"].items()
    }
    port = free_port()
    command = [interpolate(str(part), {}) for part in service["command"]]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client: Any = redis.Redis(port=port, password=password, socket_timeout=5)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, "redis did not start"
                time.sleep(0.05)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).set("k", "v")
        assert password.encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes()
        kind, check = service["healthcheck"]["test"]
        assert kind == "CMD-SHELL"  # run by /bin/sh -c in the container, with its environment
        check = interpolate(check, {}).replace("redis-cli", f"redis-cli -p {port}")
        healthy = subprocess.run(["sh", "-c", check], env=env, timeout=30)
        assert healthy.returncode == 0
        without = subprocess.run(["sh", "-c", check], env={**env, "REDIS_PASSWORD": "wrong"},
                                 timeout=30)  # fmt: skip
        assert without.returncode != 0
    finally:
        process.terminate()
        process.wait(30)
