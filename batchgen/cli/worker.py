"""``batchgen worker``: serve a model's queue with one engine per GPU (or N on CPU)."""

from __future__ import annotations

import logging
from dataclasses import replace

import click

from batchgen.cli._common import (
    connect,
    handles_errors,
    model_impl_option,
    quantization_option,
    redis_option,
    threads_option,
)


@click.command("worker")
@click.option("--model", required=True, help="Model path or name (as jobs were submitted with).")
@click.option("--gpus", default=None, help="'all', '0-7' or '0,2,5': one worker process per GPU.")
@click.option("--device", default=None, help="cpu, cuda, ... (default: the engine's choice).")
@click.option(
    "--workers", type=int, default=None, help="Number of CPU worker processes (default 1)."
)
@click.option(
    "--burst", is_flag=True, help="Exit 0 once the queue is empty and nothing is in flight."
)
@click.option(
    "--max-num-seqs",
    type=int,
    default=256,
    show_default=True,
    help="Requests one engine runs at once; it holds max(2, N // 4) more queued behind them.",
)
@click.option(
    "--num-kv-blocks", type=int, default=None,
    help="KV cache blocks of 16 tokens. Default: as many as fit 1 GiB on CPU (its pages used "
    "only as blocks fill); on CUDA 0.9 of the GPU's memory less what is in use and a 2 GiB "
    "margin (docs/sizing.md).",
)  # fmt: skip
@click.option("--max-model-len", type=int, default=None, help="Cap the context length.")
@model_impl_option
@quantization_option
@threads_option
@click.option(
    "--tensor-parallel-size", type=int, default=1, show_default=True,
    help="Ranks (GPUs with --gpus, processes on --device cpu) that split one engine's model; "
    "with --gpus it must divide the GPU count: --gpus 0-7 --tensor-parallel-size 4 starts two "
    "engines of four GPUs (docs/fleet.md).",
)  # fmt: skip
@click.option(
    "--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port."
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Interface the metrics port listens on (no authentication: loopback "
                   "unless you open it, e.g. 0.0.0.0).")  # fmt: skip
@click.option("--metrics-tenants", is_flag=True,
              help="Add per-tenant usage families (they name every tenant).")  # fmt: skip
@click.option("--claim-timeout", type=float, default=60.0, show_default=True,
              help="Seconds before a silent worker's requests are taken over.")  # fmt: skip
@click.option("--max-attempts", type=int, default=3, show_default=True,
              help="Deliveries before a request is dead-lettered.")  # fmt: skip
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="On SIGTERM: seconds to commit and hand back before exiting.")  # fmt: skip
@redis_option
@handles_errors
def worker(
    model: str, gpus: str | None, device: str | None, workers: int | None, burst: bool,
    max_num_seqs: int, num_kv_blocks: int | None, max_model_len: int | None, model_impl: str,
    quantization: str | None, threads: int | None, tensor_parallel_size: int,
    metrics_port: int | None, metrics_host: str, metrics_tenants: bool, claim_timeout: float,
    max_attempts: int, drain_timeout: float, redis_url: str | None,
) -> None:  # fmt: skip
    """Pull MODEL's requests from Redis, generate, and write Parquet rows.

    Starts one engine process per GPU (--gpus, each with its own
    CUDA_VISIBLE_DEVICES), or per group of --tensor-parallel-size GPUs, or
    --workers N processes on --device cpu; a crashed process is restarted. Also runs the finalize tasks that write finished
    jobs' outputs. SIGTERM/SIGINT: in-flight requests are handed back to the
    queue with their tokens so far, then it exits. A MODEL that cannot be loaded
    (no such directory, no checkpoint in it, an architecture batchgen does not
    run) is one line on stderr and exit 2, before any job is touched.
    """
    from batchgen.jobs.environment import check_values
    from batchgen.jobs.redis.keys import prefix_from_env
    from batchgen.jobs.schema.model_files import check_checkpoint
    from batchgen.worker.engine_config import EngineConfig
    from batchgen.worker.loop.loop_config import LoopConfig
    from batchgen.worker.supervisor.supervisor import Supervisor, plan_children

    check_values()  # its finalizer and engine processes read them later, where no one sees
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    engine = EngineConfig(
        device=device, max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len, model_impl=model_impl, threads=threads,
        tensor_parallel_size=tensor_parallel_size, quantization=quantization,
    )  # fmt: skip
    plan = plan_children(gpus, device, workers, threads, tensor_parallel_size)
    check_checkpoint(model)  # a typo or a hub id: one line now, not five failed children
    engine = replace(engine, device=plan[0]["device"])
    conn, _, target = connect(redis_url)
    base = LoopConfig(
        model=model, redis_url=target.url, prefix=prefix_from_env(), burst=burst,
        max_attempts=max_attempts, claim_timeout_s=claim_timeout, drain_timeout_s=drain_timeout,
        engine=engine,
    )  # fmt: skip
    sup = Supervisor(conn, base, [p["env"] for p in plan], metrics_port,
                     metrics_host=metrics_host, tenant_metrics=metrics_tenants)  # fmt: skip
    raise SystemExit(sup.run())
