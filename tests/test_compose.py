"""docker-compose.yml: a durable Redis, a GPU worker, and commands the CLI really has.

No Docker engine runs here, so the file is checked as data: every batchgen
command it runs must parse with the real CLI's options.
"""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from batchgen.cli import main

REPO = Path(__file__).resolve().parents[1]


def _compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _entrypoint() -> list[str]:
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("ENTRYPOINT"):
            return yaml.safe_load(line.removeprefix("ENTRYPOINT").strip())
    raise AssertionError("Dockerfile has no ENTRYPOINT")


def test_redis_is_durable_and_never_evicts():
    redis = _compose()["services"]["redis"]
    command = [str(part) for part in redis["command"]]
    assert command[0] == "redis-server"
    flags = dict(zip(command[1::2], command[2::2]))
    assert flags == {
        "--appendonly": "yes",
        "--appendfsync": "everysec",
        "--maxmemory-policy": "noeviction",
    }
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-data" in _compose()["volumes"]


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
