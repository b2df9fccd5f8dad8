"""How many requests per second ``batchgen serve`` answers for the two calls a client
polls or pulls: ``batches.retrieve`` and ``files.content`` of a 10k-line output.

    .venv/bin/python benchmarks/serve_bench.py
    .venv/bin/python benchmarks/serve_bench.py --lines 10000 --threads 4 --seconds 10

Runs everything for real in a temp dir: a private redis-server, ``batchgen serve``
and one CPU ``batchgen worker`` on a tiny toy checkpoint (subprocesses), and the
``openai`` client. The batch of ``--lines`` requests runs to completion first;
then each call is made by ``--threads`` clients (one ``OpenAI`` client per
thread, keep-alive) for ``--seconds``, and again as plain keep-alive HTTP GETs
(http.client), which shows the server's share without the client's parsing.
Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from openai import OpenAI

from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer, free_port
from batchgen.toy import write_toy_checkpoint

KEY = "bench-key"


def start(tmp: Path, name: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115
    return subprocess.Popen([sys.executable, "-m", "batchgen", *args], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def rate(call: Callable[[Any], Any], make: Callable[[], Any], threads: int,
         seconds: float) -> dict[str, float]:  # fmt: skip
    """Calls per second over ``seconds``, ``threads`` clients at once."""
    counts = [0] * threads
    latencies: list[list[float]] = [[] for _ in range(threads)]
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        client = make()
        call(client)  # warm: connection open
        while time.monotonic() < stop:
            t = time.perf_counter()
            call(client)
            latencies[k].append(time.perf_counter() - t)
            counts[k] += 1

    started = time.monotonic()
    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - started
    flat = sorted(x for lat in latencies for x in lat)
    return {"requests": sum(counts), "per_s": round(sum(counts) / elapsed, 1),
            "p50_ms": round(1000 * flat[len(flat) // 2], 2),
            "p99_ms": round(1000 * flat[int(len(flat) * 0.99)], 2)}  # fmt: skip


def http_client(port: int) -> Callable[[], http.client.HTTPConnection]:
    return lambda: http.client.HTTPConnection("127.0.0.1", port, timeout=60)


def http_get(port: int, path: str) -> Callable[[http.client.HTTPConnection], Any]:
    def call(conn: http.client.HTTPConnection) -> bytes:
        conn.request("GET", path, headers={"Authorization": f"Bearer {KEY}"})
        reply = conn.getresponse()
        body = reply.read()
        assert reply.status == 200, body[:200]
        return body

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batchgen-serve-bench-") as root:
        tmp = Path(root)
        redis_server = RedisServer(tmp / "redis")
        redis_server.start()
        model = write_toy_checkpoint(tmp / "toy", arch="llama", size="tiny")
        port = free_port()
        env = {**os.environ, "BATCHGEN_REDIS_URL": redis_server.url, "OMP_NUM_THREADS": "1",
               "BATCHGEN_HOME": str(tmp / "home")}  # fmt: skip
        procs = [
            start(tmp, "serve", env, "serve", "--port", str(port), "--api-key", KEY,
                  "--files-dir", str(tmp / "files"), "--output-root", str(tmp / "out")),
            start(tmp, "worker", env, "worker", "--model", str(model), "--device", "cpu",
                  "--max-num-seqs", "128"),
        ]  # fmt: skip
        try:
            base = f"http://127.0.0.1:{port}/v1"

            def make() -> OpenAI:
                return OpenAI(base_url=base, api_key=KEY, max_retries=0)

            client = make()
            wait(lambda: client.files.list() is not None, 60, "batchgen serve")
            path = tmp / "input.jsonl"
            with path.open("w") as f:
                for i in range(args.lines):
                    body = {"model": str(model), "max_tokens": args.max_tokens,
                            "messages": [{"role": "user", "content": f"Item {i}: describe it."}]}  # fmt: skip
                    f.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                        "url": "/v1/chat/completions", "body": body}) + "\n")  # fmt: skip
            with path.open("rb") as src:
                file = client.files.create(file=src, purpose="batch")
            conn = redis.Redis.from_url(redis_server.url)
            wait(lambda: conn.zcard(Keys.from_env().workers) > 0, 120, "a worker's heartbeat")
            t0 = time.monotonic()
            batch_id = client.batches.create(input_file_id=file.id, completion_window="24h",
                                             endpoint="/v1/chat/completions").id  # fmt: skip
            wait(lambda: client.batches.retrieve(batch_id).status in ("completed", "failed"),
                 3600, "the batch to complete")  # fmt: skip
            done = client.batches.retrieve(batch_id)
            if done.status != "completed" or not done.output_file_id:
                raise SystemExit(f"batch {done.status}: {done.errors}")
            batch_s = time.monotonic() - t0
            output_id = done.output_file_id
            size = client.files.retrieve(output_id).bytes
            retrieve = rate(
                lambda c: c.batches.retrieve(batch_id), make, args.threads, args.seconds
            )
            content = rate(lambda c: c.files.content(output_id).content, make, args.threads,
                           args.seconds)  # fmt: skip
            # the same calls as plain keep-alive HTTP: the server's share, without the client's
            raw_retrieve = rate(http_get(port, f"/v1/batches/{batch_id}"), http_client(port),
                                args.threads, args.seconds)  # fmt: skip
            raw_content = rate(http_get(port, f"/v1/files/{output_id}/content"), http_client(port),
                               args.threads, args.seconds)  # fmt: skip
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
            redis_server.kill()

    result = {"lines": args.lines, "threads": args.threads, "batch_wall_s": round(batch_s, 1),
              "output_bytes": size, "batches.retrieve": retrieve, "files.content": content,
              "files.content_MB_per_s": round(content["per_s"] * size / 1e6, 1),
              "http GET batch": raw_retrieve, "http GET content": raw_content}  # fmt: skip
    print(f"{'call':<24} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for name in ("batches.retrieve", "files.content", "http GET batch", "http GET content"):
        r = result[name]
        print(f"{name:<24} {r['per_s']:>8} {r['p50_ms']:>8} {r['p99_ms']:>8}")
    print(f"(a {args.lines}-line output of {size / 1e6:.1f} MB; {args.threads} client threads; "
          f"the batch itself ran in {batch_s:.0f} s)")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
