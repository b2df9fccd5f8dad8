"""batchgen serve: OpenAI's Files and Batches API, and a live dashboard, over the queue."""

from __future__ import annotations

import signal

import click

from batchgen.cli._common import handles_errors, redis_option


@click.command(context_settings={"show_default": True})
@click.option("--host", default="127.0.0.1", help="Address to listen on.")
@click.option("--port", default=8000, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--api-key", "api_keys", multiple=True, metavar="KEY",
              help="A key clients send as 'Authorization: Bearer KEY' (repeat for several), "
              "each its own tenant; default $BATCHGEN_API_KEYS (comma-separated). Without "
              "any key the server listens on loopback only and asks for none.")  # fmt: skip
@click.option("--keys-file", metavar="PATH", default=None,
              help="Keys and their tenants, one a line: 'KEY TENANT' or 'KEY TENANT admin' "
              "(an admin sees every tenant's batches, files and jobs). [env: "
              "BATCHGEN_KEYS_FILE]")  # fmt: skip
@click.option("--files-dir", metavar="URI", default=None,
              help="Where uploaded and result files live (local path or s3://, gs://, ...). "
              "Default: $BATCHGEN_HOME/files (local).")  # fmt: skip
@click.option("--output-root", metavar="URI", default=None,
              help="Each batch's job writes its Parquet under URI/BATCH_ID. Default: "
              "$BATCHGEN_OUTPUT_ROOT, as for submit.")  # fmt: skip
@click.option("--max-file-size", "max_file_mb", default=200, type=click.IntRange(1),
              help="Largest upload in MB; larger ones get 413.")  # fmt: skip
@click.option("--file-expiry", default="30d", metavar="DURATION|never",
              help="Uploads expire this long after they are made, unless the upload's "
              "expires_after says otherwise.")  # fmt: skip
@click.option("--output-expiry", default="30d", metavar="DURATION|never",
              help="A batch's output files, and then the batch, expire this long after "
              "they are written, unless the batch's output_expires_after says otherwise.")  # fmt: skip
@click.option("--model-wait", "model_wait_s", default=600.0, type=click.FloatRange(0),
              help="Seconds a new batch waits for a worker that is starting for its model "
              "(loading, hashing its weights) before it fails with model_not_found.")  # fmt: skip
@click.option("--refresh", "refresh_s", default=2.0, type=click.FloatRange(0.1),
              help="Seconds between the dashboard's refreshes.")  # fmt: skip
@click.option("--sample", "sample_s", default=5.0, type=click.FloatRange(0.1),
              help="Seconds between the tok/s samples of the dashboard's chart.")  # fmt: skip
@click.option("--lease", "lease_s", default=10.0, type=click.FloatRange(1), hidden=True,
              help="Seconds a batch's validation or output writing is held without renewal "
              "(how soon another server takes over from one that died).")  # fmt: skip
@redis_option
@handles_errors
def serve(
    host: str, port: int, api_keys: tuple[str, ...], keys_file: str | None,
    files_dir: str | None, output_root: str | None, max_file_mb: int, file_expiry: str,
    output_expiry: str, model_wait_s: float, refresh_s: float, sample_s: float, lease_s: float,
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
    from batchgen.jobs.environment import KEYS_FILE
    from batchgen.jobs.redis import embedded
    from batchgen.jobs.storage.names import output_root as default_output_root
    from batchgen.serve.api_keys import KeyRing
    from batchgen.serve.app import create_app
    from batchgen.serve.listen import listen
    from batchgen.serve.settings import LOOPBACK, ServeConfig, expiry, keys_from_env

    keyring = KeyRing.load(keys_from_env(api_keys), keys_file or KEYS_FILE.get())
    if keyring.open and host not in LOOPBACK:
        raise click.UsageError(
            f"--host {host}: without an API key the server listens on loopback only; "
            "give --api-key KEY (or BATCHGEN_API_KEYS, --keys-file) to listen on other "
            "addresses"
        )
    config = ServeConfig(
        files_dir=files_dir or str(embedded.home() / "files"),
        output_root=output_root or str(default_output_root()),
        redis_url="", keyring=keyring, max_file_bytes=max_file_mb << 20,
        sample_s=sample_s, refresh_ms=int(refresh_s * 1000), lease_s=lease_s,
        model_wait_s=model_wait_s, file_expiry_s=expiry(file_expiry, "--file-expiry"),
        output_expiry_s=expiry(output_expiry, "--output-expiry"),
    )  # fmt: skip
    sock = listen(host, port)  # first: a busy port stops here, before anything else runs
    if keyring.open:
        click.echo("batchgen serve: no API key given: listening on loopback only, no key "
                   "asked (anyone on this machine can use it)", err=True)  # fmt: skip
    conn, keys, target = connect(redis_url)
    config.redis_url = target.url
    app = create_app(config, conn, keys)
    bound = sock.getsockname()[1]
    click.echo(f"batchgen serve: http://{host}:{bound}/ (API at /v1)", err=True)
    signal.signal(signal.SIGHUP, lambda *_: keyring.reload())  # uvicorn leaves SIGHUP alone
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])
