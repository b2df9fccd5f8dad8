"""GPU check for the Triton kernels: correctness, decode bandwidth, engine tok/s.

    python benchmarks/gpu_check.py [--out result.json]   # one GPU, < 5 minutes
    python benchmarks/gpu_check.py --dry-run              # CPU, Triton interpreter, tiny shapes

Needs only torch, triton, transformers and safetensors: the repository root is
put on sys.path, and batchgen (``batchgen/parts.py``) then finds ``kernels/``,
``worker/`` and ``jobs/`` beside it, so ``import batchgen.kernels`` works uninstalled.
Prints a short table on stderr and the JSON result on stdout. Sections:

1. correctness: every Triton op against its reference on the device (bf16,
   realistic shapes): max abs error and pass/fail.
2. bandwidth: paged decode attention's K/V bytes read / time against the
   device's copy bandwidth ((read + written bytes) / time of a big
   device-to-device copy), batch 64/128/256 x context 512/2k/8k, Llama-3-8B
   attention (32 heads, 8 KV heads, head_dim 128). Target: >= 70% at 128 x 2k.
3. engine: output tok/s of batchgen's engine against HF transformers'
   continuous batching on a random Llama-3.2-1B-shaped bf16 checkpoint.
4. moe: the Triton fused-MoE kernel against the per-expert loop oracle at
   Mixtral, Qwen3-MoE, gpt-oss and DeepSeek-V3 expert shapes, and its ms per
   call against the same grouped algorithm in plain torch (gpu_moe.py).

An exception inside a section (or a case) is reported in the JSON and the
script goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


from benchmarks.gpu_bench import DRY_RUN, GPU, Bench  # noqa: E402
from benchmarks.gpu_engine import engine  # noqa: E402
from benchmarks.gpu_kernels import bandwidth, correctness  # noqa: E402
from benchmarks.gpu_moe import moe, table_lines  # noqa: E402

SECTIONS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "correctness": correctness,
    "bandwidth": bandwidth,
    "engine": engine,
    "moe": moe,
}


def table(result: dict[str, Any]) -> str:
    lines = [f"gpu_check ({result['mode']}) on {result['env'].get('device_name')}"]
    corr = result["sections"].get("correctness", {})
    for name, r in corr.items():
        if isinstance(r, dict):
            parts = r.items() if "pass" not in r else [("", r)]
            for sub, x in parts:
                status = "pass" if x.get("pass") else f"FAIL {x.get('error', '')}"
                status = f"skipped ({x['skipped']})" if "skipped" in x else status
                lines.append(
                    f"  {name} {sub}".rstrip().ljust(36)
                    + f"{status:8} err {x.get('max_abs_err', float('nan')):.3g}"
                )
    bw = result["sections"].get("bandwidth", {})
    if "decode" in bw:
        lines.append(f"  copy bandwidth {bw['copy_gb_per_s']:.0f} GB/s")
        lines.append("  batch  context  splits      ms    GB/s  of copy")
        for r in bw["decode"]:
            lines.append(
                f"  {r['batch']:5}  {r['context']:7}  {r['num_splits']:6}  {r['ms']:6.3f}  {r['gb_per_s']:6.0f}  {r['fraction_of_copy']:6.0%}"
            )
    if "moe" in result["sections"]:
        lines.extend(table_lines(result["sections"]["moe"]))
    for name, section in result["sections"].items():
        if "error" in section:
            lines.append(f"  {name}: ERROR {section['error']}")
    engine = result["sections"].get("engine", {})
    if isinstance(engine.get("engine"), dict):
        ours, hf = engine["engine"], engine["hf_continuous_batching"]
        lines.append(
            f"  engine {ours['output_tok_s']:.0f} output tok/s ({ours['ops']} ops), "
            f"HF continuous batching {hf['output_tok_s']:.0f}: {engine['speedup']:.2f}x; "
            f"CUDA-graph replays {ours['cuda_graph_replays']} of {ours['steps']} steps"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes"
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.dry_run:  # before anything defines the kernels
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    device = "cpu" if args.dry_run else "cuda"
    result: dict[str, Any] = {
        "mode": "dry-run" if args.dry_run else "gpu",
        "env": {},
        "sections": {},
    }
    try:
        import transformers
        import triton

        import batchgen

        result["env"] = {
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "batchgen": str(Path(batchgen.__file__).parent),
            "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        }  # fmt: skip
        shapes = DRY_RUN if args.dry_run else GPU
        result["shapes"] = asdict(shapes)
        bench = Bench(shapes, device)
    except Exception as exc:
        result["error"] = repr(exc)
        print(json.dumps(result, indent=2))
        return result
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            result["sections"][name] = SECTIONS[name](bench)
        except Exception as exc:  # one broken section must not hide the others
            result["sections"][name] = {
                "error": repr(exc),
                "traceback": traceback.format_exc(limit=6),
            }
        result["sections"][name]["seconds"] = time.perf_counter() - t0
        if device == "cuda":
            torch.cuda.empty_cache()
    print(table(result), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return result


if __name__ == "__main__":
    main()
