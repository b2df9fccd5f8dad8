"""GPU check for the Triton kernels: correctness, decode bandwidth, fused MoE, engine tok/s.

    python benchmarks/gpu_check.py --out DIR            # one GPU, 8 minutes at most (or OUT=DIR)
    python benchmarks/gpu_check.py --dry-run --out DIR  # CPU, Triton interpreter, tiny shapes

Runs from a plain checkout, never installed, with only torch, triton and
transformers (and what they bring: safetensors, tokenizers): no Redis, rq or
llguidance. Each section runs in a child process of its own
(``python -P -m benchmarks.gpu_check --section NAME``) under its own time limit,
cheapest first, so a sticky CUDA error, a crash or a hang loses that section
only; on a GPU the whole run keeps within ``--budget`` (480 s): each limit is cut to
what is left of it, and a section with under a second left is recorded as not run. The
children import from a temporary folder that holds links to the checkout's
``batchgen/`` and ``benchmarks/`` and nothing else: ``batchgen`` (``batchgen/parts.py``,
which puts that folder on the path of the processes it starts) finds ``kernels/``, ``worker/`` and ``jobs/`` beside
itself as ``batchgen.kernels`` and so on, while no folder of the checkout can
pass for a package of its name (Hugging Face's ``kernels``, which transformers
imports). The repository's root is on no process's ``sys.path``.

As each section ends, ``DIR/<section>.json`` holds ``{"section", "ok",
"seconds", "mode", "env", "result"}`` (``"error"`` in place of ``"result"``
when it raised, timed out, died or was not run) and ``DIR/<section>.log`` its stderr; a
progress line goes to stdout. The exit code is 1 if any section failed. Sections:

1. correctness: every Triton op against its reference on the device (bf16,
   realistic shapes), DeepSeek's MLA decode included: max abs error and pass/fail.
2. bandwidth: paged decode attention's K/V bytes read / time against the
   device's copy bandwidth ((read + written bytes) / time of a big
   device-to-device copy), batch 64/128/256 x context 512/2k/8k, Llama-3-8B
   attention (32 heads, 8 KV heads, head_dim 128). Target: >= 70% at 128 x 2k.
   Also the MLA decode kernel (DeepSeek-V3: 128 heads over 512 + 64 latent rows) at 128 x 2k.
3. moe: the Triton fused-MoE kernel against the per-expert loop oracle at
   Mixtral, Qwen3-MoE, gpt-oss and DeepSeek-V3 expert shapes, and its ms per
   call against the same grouped algorithm in plain torch (gpu_moe.py).
4. quant_gemm: the block-scaled FP8 GEMM and the W4A16 (GPTQ, AWQ) GEMM
   against dequantize-then-matmul, and their TFLOP/s at Llama-3-70B layer
   shapes against the device's FP8/BF16 peak (gpu_quant.py).
5. engine: output tok/s of batchgen's engine against HF transformers'
   continuous batching on a random Llama-3.2-1B-shaped bf16 checkpoint; and the
   engine's on that checkpoint stored as block FP8, its projections on the FP8 GEMM.
6. pipeline: the whole pipeline once, as a user runs it: ``batchgen submit`` ->
   ``batchgen worker --gpus 0 --burst`` -> ``batchgen download``, one Parquet row per
   input line; the packages the machine lacks come from the carried wheelhouse
   (``make gpu-wheels``; gpu_pipeline.py).
7. tensor_parallel: a Llama-3.3-70B-shaped random bf16 checkpoint written on the
   machine (as many of its 80 layers as fit, the bound recorded) through the engine
   over min(2, GPUs) ranks: load time, decode step time against the (weights + KV) /
   bandwidth roofline per rank, greedy tokens against one rank (gpu_tensor_parallel.py).

A section is ok when it ran to its end and its checks (``all_pass``) hold;
performance targets (``target_met``) are reported, not failed on.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# the whole GPU run's time (issue 32: 8 minutes on one H100); a section's limit is cut to
# what is left of it, so the last (dearest) sections give way when the first run long
GPU_BUDGET_S = 480.0
IMPORTABLE = ("batchgen", "benchmarks")  # all a child may import from the checkout


@dataclass(frozen=True)
class Section:
    module: str  # holds a function named like the section: Bench -> results
    gpu_limit_s: float
    dry_run_limit_s: float


SECTIONS = {  # cheapest first
    "correctness": Section("benchmarks.gpu_kernels", 120, 120),
    "bandwidth": Section("benchmarks.gpu_kernels", 90, 120),
    "moe": Section("benchmarks.gpu_moe", 150, 120),
    "quant_gemm": Section("benchmarks.gpu_quant", 150, 120),
    "engine": Section("benchmarks.gpu_engine", 270, 240),
    "pipeline": Section("benchmarks.gpu_pipeline", 180, 240),
    "tensor_parallel": Section("benchmarks.gpu_tensor_parallel", 180, 180),
}


def section_lines(name: str, result: dict[str, Any]) -> list[str]:
    """The section's rows of the table printed as it ends."""
    lines: list[str] = []
    if name == "correctness":
        for case, r in result.items():
            if isinstance(r, dict):
                parts = r.items() if "pass" not in r else [("", r)]
                for sub, x in parts:
                    status = "pass" if x.get("pass") else f"FAIL {x.get('error', '')}"
                    status = f"skipped ({x['skipped']})" if "skipped" in x else status
                    lines.append(
                        f"  {case} {sub}".rstrip().ljust(36)
                        + f"{status:8} err {x.get('max_abs_err', float('nan')):.3g}"
                    )
    elif name == "bandwidth":
        lines.append(f"  copy bandwidth {result['copy_gb_per_s']:.0f} GB/s")
        lines.append("  batch  context  splits      ms    GB/s  of copy")
        for r in result["decode"]:
            lines.append(
                f"  {r['batch']:5}  {r['context']:7}  {r['num_splits']:6}  {r['ms']:6.3f}  {r['gb_per_s']:6.0f}  {r['fraction_of_copy']:6.0%}"
            )
        if "mla_decode" in result:
            r = result["mla_decode"]
            lines.append(
                f"  MLA {r['heads']} heads  {r['batch']:5}  {r['context']:7}  {r['ms']:6.3f} ms  "
                f"{r['gb_per_s']:6.0f} GB/s  {r['fraction_of_copy']:6.0%} of copy"
            )
    elif name == "moe":
        from benchmarks.gpu_moe import table_lines

        lines.extend(table_lines(result))
    elif name == "quant_gemm":
        from benchmarks.gpu_quant import table_lines as quant_lines

        lines.extend(quant_lines(result))
    elif name == "tensor_parallel":
        from benchmarks.gpu_tensor_parallel import table_lines as tp_lines

        lines.extend(tp_lines(result))
    elif name == "pipeline":
        from benchmarks.gpu_pipeline import table_lines as pipeline_lines

        lines.extend(pipeline_lines(result))
    elif name == "engine" and isinstance(result.get("engine"), dict):
        ours, hf = result["engine"], result["hf_continuous_batching"]
        against = (
            f"HF continuous batching {hf['output_tok_s']:.0f}: {result['speedup']:.2f}x"
            if result["speedup"] is not None else f"HF continuous batching skipped ({hf['skipped']})"
        )  # fmt: skip
        lines.append(
            f"  engine {ours['output_tok_s']:.0f} output tok/s ({ours['ops']} ops), {against}; "
            f"CUDA-graph replays {ours['cuda_graph_replays']} of {ours['steps']} steps"
        )
        fp8 = result.get("engine_fp8_block")
        if isinstance(fp8, dict):
            lines.append(
                f"  engine, block FP8 checkpoint: {fp8['output_tok_s']:.0f} output tok/s "
                f"({fp8['ops']} ops), {fp8['on_quant_gemms']} of {fp8['quantized_projections']} "
                f"quantized projections on the FP8 GEMM, {fp8['quantized_mib']:.1f} MiB"
            )
    return lines


def write_record(out: Path, record: dict[str, Any]) -> None:
    """``out/<section>.json``, whole or not at all (a child may be killed any time)."""
    path = out / f"{record['section']}.json"
    part = path.with_suffix(".json.part")
    part.write_text(json.dumps(record, indent=2))
    os.replace(part, path)


def run_section(name: str, dry_run: bool, out: Path) -> int:
    """One section in this process (a child's work): its record, its table on stdout."""
    if dry_run:  # before anything defines the kernels
        os.environ["TRITON_INTERPRET"] = "1"
    t0 = time.perf_counter()
    record: dict[str, Any] = {"section": name, "ok": False, "mode": "dry-run" if dry_run else "gpu"}
    try:
        import torch
        import transformers
        import triton

        import batchgen
        from benchmarks.gpu_bench import DRY_RUN, GPU, Bench, backport_interpreter_index

        device = "cpu" if dry_run else "cuda"
        backported = dry_run and backport_interpreter_index()
        kernels = importlib.util.find_spec("kernels")
        record["env"] = {
            "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__,
            "batchgen": str(Path(batchgen.__file__).resolve().parent),
            # which top-level `kernels` transformers gets: Hugging Face's or none, never the checkout's
            "kernels": kernels and (kernels.origin or f"namespace {list(kernels.submodule_search_locations or [])}"),
            "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "interpreter_index_backported": backported,
        }  # fmt: skip
        shapes = DRY_RUN if dry_run else GPU
        record["shapes"] = asdict(shapes)
        measure = getattr(importlib.import_module(SECTIONS[name].module), name)
        result = measure(Bench(shapes, device))
        record["ok"] = result.get("all_pass") is not False
        record["result"] = result
    except Exception as exc:
        record["error"] = repr(exc)
        record["traceback"] = traceback.format_exc(limit=8)
        print(record["traceback"], file=sys.stderr)
    record["seconds"] = time.perf_counter() - t0
    write_record(out, record)
    if "result" in record:
        print("\n".join(section_lines(name, record["result"])), flush=True)
    return 0 if record["ok"] else 1


def importable_folder(where: Path) -> Path:
    """A folder exposing only ``IMPORTABLE`` of the checkout, for the children's path."""
    for name in IMPORTABLE:
        (where / name).symlink_to(REPO / name, target_is_directory=True)
    return where


def child_environ(importable: Path, dry_run: bool) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(importable), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    return env


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_child(
    name: str, dry_run: bool, out: Path, limit_s: float, env: dict[str, str]
) -> dict[str, Any]:
    """Run one section as a child under its time limit; its record, whoever wrote it."""
    path, log = out / f"{name}.json", out / f"{name}.log"
    path.unlink(missing_ok=True)  # a record from an earlier run is no result of this one
    command = [sys.executable, "-P", "-m", "benchmarks.gpu_check", "--section", name,
               "--out", str(out), *(["--dry-run"] if dry_run else [])]  # fmt: skip
    t0 = time.perf_counter()
    with open(log, "wb") as sink:
        child = subprocess.Popen(command, env=env, stderr=sink, start_new_session=True)
        try:
            code: int | None = child.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # out of time, or this process interrupted: the child's group goes too
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # timed out or died before its record was written
        error = f"timed out after {limit_s:g} s" if code is None else (
            f"exited with code {code} before writing its result")  # fmt: skip
        record = {"section": name, "ok": False, "mode": "dry-run" if dry_run else "gpu",
                  "seconds": time.perf_counter() - t0, "error": error,
                  "log_tail": log_tail(log)}  # fmt: skip
        write_record(out, record)
        return record


def parse_limits(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, float]:
    limits = {}
    for item in items:
        name, _, seconds = item.partition("=")
        try:
            limits[name] = float(seconds)
        except ValueError:
            parser.error(f"--limit {item!r}: use SECTION=SECONDS, e.g. engine=300")
        if name not in SECTIONS:
            parser.error(f"--limit {item!r}: no section {name!r}; sections: {', '.join(SECTIONS)}")
    return limits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes"
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated subset (run in order)"
    )
    parser.add_argument(
        "--out", type=Path, default=os.environ.get("OUT") or None,
        help="folder for <section>.json and <section>.log (default: $OUT)",
    )  # fmt: skip
    parser.add_argument(
        "--limit", action="append", default=[], metavar="SECTION=SECONDS",
        help="another time limit for a section (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--budget", type=float, default=None, metavar="SECONDS",
        help=f"the whole run's time: each section's limit is cut to what is left of it "
             f"(default {GPU_BUDGET_S:g} on a GPU, none on the dry run)",
    )  # fmt: skip
    parser.add_argument("--section", choices=SECTIONS, help="run one section in this process")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("give --out DIR or set OUT: each section's result is written there")
    names = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        parser.error(f"--sections {args.sections!r}: the sections are {', '.join(SECTIONS)}")
    limits = parse_limits(parser, args.limit)
    if args.budget is not None and not args.budget > 0:
        parser.error(f"--budget {args.budget:g}: give the run's seconds, a number > 0")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return run_section(args.section, args.dry_run, args.out)

    mode = "dry-run" if args.dry_run else "gpu"
    names = [name for name in SECTIONS if name in names]
    failed: list[str] = []
    budget = args.budget if args.budget is not None or args.dry_run else GPU_BUDGET_S
    deadline = None if budget is None else time.monotonic() + budget
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        env = child_environ(importable_folder(Path(tmp)), args.dry_run)
        for i, name in enumerate(names, 1):
            section = SECTIONS[name]
            limit = limits.get(
                name, section.dry_run_limit_s if args.dry_run else section.gpu_limit_s
            )
            left = float("inf") if deadline is None else deadline - time.monotonic()
            if left < 1:  # the sections after it are the dearer ones: none is started
                record = {"section": name, "ok": False, "mode": mode, "seconds": 0.0,
                          "error": f"not run: the run's budget of {budget:g} s was spent"}  # fmt: skip
                write_record(args.out, record)
            else:
                limit = min(limit, round(left, 1))
                print(f"gpu_check [{i}/{len(names)}] {name}: running, limit {limit:g} s",
                      flush=True)  # fmt: skip
                record = run_child(name, args.dry_run, args.out, limit, env)
            where = record.get("env", {}).get("device_name", "")
            status = "ok" if record["ok"] else f"FAILED: {record.get('error', 'a check failed')}"
            print(f"gpu_check [{i}/{len(names)}] {name}: {status} "
                  f"({record['seconds']:.1f} s{', ' + where if where else ''})", flush=True)  # fmt: skip
            if not record["ok"]:
                failed.append(name)
    ok = len(names) - len(failed)
    print(f"gpu_check ({mode}): {ok} of {len(names)} sections ok"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}; results in {args.out}",
          flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
