"""batchgen serve: OpenAI's Files and Batches API, and a live dashboard, over the queue."""

from __future__ import annotations

import click

from batchgen.cli._common import handles_errors, redis_option


@click.command(context_settings={"show_default": True})
@click.option("--host", default="127.0.0.1", help="Address to listen on.")
@click.option("--port", default=8000, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--api-key", "api_keys", multiple=True, metavar="KEY",
              help="A key clients send as 'Authorization: Bearer KEY' (repeat for several); "
              "default $BATCHGEN_API_KEYS (comma-separated). Without any key the server "
              "listens on loopback only and asks for none.")  # fmt: skip
@click.option("--files-dir", metavar="URI", default=None,
              help="Where uploaded and result files live (local path or s3://, gs://, ...). "
              "Default: $BATCHGEN_HOME/files (local).")  # fmt: skip
@click.option("--output-root", metavar="URI", default=None,
              help="Each batch's job writes its Parquet under URI/BATCH_ID. Default: "
              "$BATCHGEN_OUTPUT_ROOT, as for submit.")  # fmt: skip
@click.option("--max-file-size", "max_file_mb", default=200, type=click.IntRange(1),
              help="Largest upload in MB; larger ones get 413.")  # fmt: skip
@click.option("--refresh", "refresh_s", default=2.0, type=click.FloatRange(0.1),
              help="Seconds between the dashboard's refreshes.")  # fmt: skip
@click.option("--sample", "sample_s", default=5.0, type=click.FloatRange(0.1),
              help="Seconds between the tok/s samples of the dashboard's chart.")  # fmt: skip
@redis_option
@handles_errors
def serve(
    host: str, port: int, api_keys: tuple[str, ...], files_dir: str | None,
    output_root: str | None, max_file_mb: int, refresh_s: float, sample_s: float,
    redis_url: str | None,
) -> None:  # fmt: skip
    """Serve the OpenAI Batch API (/v1/files, /v1/batches) and the dashboard (/).

    \b
    Point the official client at it:
      client = OpenAI(base_url="http://HOST:8000/v1", api_key=KEY)
    A batch runs as a batchgen job on the workers that serve its model (each
    line's body.model); its Parquet result stays under --output-root.
    """
    import uvicorn

    from batchgen.cli._common import connect
    from batchgen.jobs.redis import embedded
    from batchgen.jobs.storage.names import output_root as default_output_root
    from batchgen.serve.app import create_app
    from batchgen.serve.settings import LOOPBACK, ServeConfig, keys_from_env

    keys_given = keys_from_env(api_keys)
    if not keys_given:
        if host not in LOOPBACK:
            raise click.UsageError(
                f"--host {host}: without an API key the server listens on loopback only; "
                "give --api-key KEY (or BATCHGEN_API_KEYS) to listen on other addresses"
            )
        click.echo("batchgen serve: no API key given: listening on loopback only, no key "
                   "asked (anyone on this machine can use it)", err=True)  # fmt: skip
    conn, keys, target = connect(redis_url)
    config = ServeConfig(
        files_dir=files_dir or str(embedded.home() / "files"),
        output_root=output_root or str(default_output_root()),
        redis_url=target.url, api_keys=keys_given, max_file_bytes=max_file_mb << 20,
        sample_s=sample_s, refresh_ms=int(refresh_s * 1000),
    )  # fmt: skip
    app = create_app(config, conn, keys)
    click.echo(f"batchgen serve: http://{host}:{port}/ (API at /v1)", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
