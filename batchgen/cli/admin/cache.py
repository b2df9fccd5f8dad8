"""``batchgen cache stats|clear``: the result cache (submit --cache) at $BATCHGEN_CACHE."""

from __future__ import annotations

import json

import click

from batchgen.cli._common import connect, handles_errors, redis_option


@click.group("cache")
def cache() -> None:
    """The result cache that jobs submitted with --cache share: rows generated once
    (greedy or seeded requests) are served again to later jobs without the engine.

    It lives at $BATCHGEN_CACHE (a folder or s3://... prefix; default
    $BATCHGEN_HOME/cache with the embedded Redis), indexed in Redis, and keeps at
    most $BATCHGEN_CACHE_MAX_BYTES (default 10G) of files, evicting the least
    recently used first.
    """


@cache.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@redis_option
@handles_errors
def stats(as_json: bool, redis_url: str | None) -> None:
    """Entries, files, bytes (and the limit), hits, misses, stored and evicted rows."""
    from batchgen.jobs.storage.result_cache import ResultCache, location

    conn, keys, target = connect(redis_url)
    figures = ResultCache(conn, keys, location(target.embedded)).stats()
    if as_json:
        click.echo(json.dumps(figures.to_dict()))
        return
    for name, value in figures.to_dict().items():
        click.echo(f"{name + ':':<9} {value}")


@cache.command("clear")
@redis_option
@handles_errors
def clear(redis_url: str | None) -> None:
    """Forget every cached row and delete the cache's files (jobs' outputs stay)."""
    from batchgen.jobs.storage.result_cache import ResultCache, location

    conn, keys, target = connect(redis_url)
    uri = location(target.embedded)
    entries, files = ResultCache(conn, keys, uri).clear()
    click.echo(f"cleared the result cache at {uri}: {entries} entries, {files} files")
