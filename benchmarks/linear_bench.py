"""A projection's product on the CPU: torch.mm against the engine's packed path.

    python benchmarks/linear_bench.py                    # tiny and small, 1-256 rows
    python benchmarks/linear_bench.py --sizes small --rows 16
    python benchmarks/linear_bench.py --dtype bfloat16 --sizes tiny,small,0.5b --rows 1,4,16

For each projection of a toy preset (fused q/k/v, o, fused gate/up, down,
LM head; 0.5b is Qwen2.5-0.5B's shape) and each row count: torch.mm on the
(in, out) weight, which copies the whole weight into the BLAS's panel layout
every call, and ``Linear`` packed once for oneDNN
(``worker/models/weights.py``), both in ``--dtype`` and warm (the best of
``--repeats`` timings after a first call). "first call" is the packed
path's first product at a new row count: oneDNN builds and caches a
primitive for each shape. In bfloat16 the fp32 packed product is timed too
("fp32 packed"): what bf16 gains over the fp32 engine. "packed" says
whether ``Linear`` packed the weight (below ``PACK_MIN`` it keeps torch.mm).
Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def shapes(size: Any) -> dict[str, tuple[int, int]]:
    """Projection name -> (in, out) of a ToySize, as the engine fuses them."""
    head_dim = size.hidden_size // size.num_heads
    qkv = (size.num_heads + 2 * size.num_kv_heads) * head_dim
    return {
        "qkv": (size.hidden_size, qkv),
        "o": (size.num_heads * head_dim, size.hidden_size),
        "gate_up": (size.hidden_size, 2 * size.intermediate_size),
        "down": (size.intermediate_size, size.hidden_size),
        "lm_head": (size.hidden_size, size.vocab_size),
    }


def best_us(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def _packed_layer(weight: Any) -> Any:
    import torch

    from batchgen.worker.models.weights import Linear

    layer = Linear(weight.clone())
    layer(torch.randn(1, weight.shape[0], dtype=weight.dtype))  # packs (when packable)
    return layer


def measure(name: str, dims: tuple[int, int], rows: int, repeats: int, dtype: Any) -> dict:
    import torch

    weight = torch.randn(*dims)
    x = torch.randn(rows, dims[0])
    result: dict[str, Any] = {"projection": name, "in": dims[0], "out": dims[1], "rows": rows}
    if dtype != torch.float32:  # the fp32 engine's product, for what bf16 gains over it
        fp32 = _packed_layer(weight)
        fp32(x)
        result["fp32_packed_us"] = round(best_us(lambda: fp32(x), repeats), 1)
        weight, x = weight.to(dtype), x.to(dtype)
    mm_us = best_us(lambda: torch.mm(x, weight), repeats)
    layer = _packed_layer(weight)
    start = time.perf_counter()
    layer(x)
    first_us = (time.perf_counter() - start) * 1e6
    packed_us = best_us(lambda: layer(x), repeats)
    return result | {
        "mm_us": round(mm_us, 1), "packed_us": round(packed_us, 1),
        "packed_first_call_us": round(first_us, 1), "packed": layer.packed is not None,
        "ratio": round(packed_us / mm_us, 3),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small", help="tiny, small, 0.5b; comma-separated")
    p.add_argument("--rows", default="1,4,16,64,256", help="row counts, comma-separated")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()

    import torch

    from benchmarks.engine_bench import toy_size

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    results = [
        {"size": size, **measure(name, dims, rows, args.repeats, dtype)}
        for size in args.sizes.split(",")
        for name, dims in shapes(toy_size(size)).items()
        for rows in (int(r) for r in args.rows.split(","))
    ]
    threads = torch.get_num_threads()
    print(json.dumps({"threads": threads, "dtype": args.dtype, "results": results}))
    print(f"\n{threads} threads, {args.dtype}; microseconds per product, best of {args.repeats}")
    fp32 = " fp32 packed |" if dtype != torch.float32 else ""
    print(f"\n| size | projection | in x out | rows | torch.mm | packed |{fp32} packed / mm "
          "| first call |")  # fmt: skip
    print("| --- | --- | --- | ---: | ---: | ---: |" + " ---: |" * (3 if fp32 else 2))
    for r in results:
        packed = f"{r['packed_us']:.0f}" + ("" if r["packed"] else " (mm)")
        extra = f" {r['fp32_packed_us']:.0f} |" if fp32 else ""
        print(
            f"| {r['size']} | {r['projection']} | {r['in']} x {r['out']} | {r['rows']} "
            f"| {r['mm_us']:.0f} | {packed} |{extra} {r['ratio']:.2f} "
            f"| {r['packed_first_call_us']:.0f} |"
        )


if __name__ == "__main__":
    main()
