"""A run's matmul floor with the engine's packed projections against torch.mm's.

    python benchmarks/packed_floor.py --model DIR --dtype bfloat16 --threads 1

Runs the "mixed" workload (``--requests``, greedy, EOS off) on one engine,
recording its step shapes, loads a second engine with packing off
(``worker/models/weights.py``'s ``packable``: every projection on
torch.mm, as before packing), and times both engines' matmul floors
(``benchmarks/matmul_floor.py``) at those shapes, in turn, ``--rounds``
times: one process, so the two share whatever else the machine runs.
Prints a JSON line a round: floors in tok/s and their ratio.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="EngineConfig.threads")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    importlib.import_module("batchgen")  # before torch, as the worker has it
    import torch
    from transformers import AutoConfig

    from batchgen import Engine, SamplingParams
    from batchgen.worker.models import weights
    from benchmarks.matmul_floor import matmul_floor_s, record_step_shapes
    from benchmarks.workloads import mixed

    wl = mixed(args.requests, AutoConfig.from_pretrained(args.model).vocab_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.max_tokens]
    kwargs = {"dtype": args.dtype, **({"threads": args.threads} if args.threads else {})}
    packed = Engine.from_pretrained(args.model, **kwargs)
    shapes = record_step_shapes(packed)
    packed.generate(wl.prompts, params)
    packable = weights.packable
    weights.packable = lambda weight: False
    try:
        plain = Engine.from_pretrained(args.model, **kwargs)
        plain.generate(wl.prompts[:1], params[:1])  # decides each projection: torch.mm
    finally:
        weights.packable = packable
    tokens = sum(wl.max_tokens)
    for _ in range(args.rounds):
        packed_s = matmul_floor_s(packed.runner.model, shapes)
        plain_s = matmul_floor_s(plain.runner.model, shapes)
        assert packed_s is not None and plain_s is not None, "a dense model's floor"
        print(json.dumps({
            "dtype": args.dtype, "threads": torch.get_num_threads(),
            "packed_floor_tok_s": round(tokens / packed_s, 1),
            "torch_mm_floor_tok_s": round(tokens / plain_s, 1),
            "packed_speedup": round(plain_s / packed_s, 2), "loadavg": os.getloadavg()[0],
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
