"""Constrained decoding's cost: the same requests with one JSON schema and without.

    python benchmarks/structured_bench.py                 # tiny and small toy models, 64 requests
    python benchmarks/structured_bench.py --sizes tiny --requests 32

Per size: 64 requests (greedy, prompts of 8-40 words) all under one JSON schema,
run to completion; then the same prompts without a constraint, each with
max_tokens set to the length its constrained run produced and EOS ignored, so
both runs generate exactly the same number of tokens with the same batch
shapes (prefix caching off, so neither reuses the other's prompts) and the
difference is the constraint's own cost. Reports output tok/s
both ways, their ratio, the time llguidance spent filling masks (on its thread,
overlapped with the model) and the part of it the step waited for after the
model had run, each as a share of the constrained run's wall time. Each size
runs in its own process on a warm engine (one untimed round first), which
imports batchgen before torch, as the worker does: its OpenMP threads
then sleep while they wait (worker/cpu_threads.py) instead of spinning
against llguidance's mask threads.
``--rounds N`` repeats everything and reports each round. Prints JSON, then a
table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "category": {"enum": ["news", "sports", "science", "arts", "other"]},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "keywords": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 4,
        },
        "published": {"type": "boolean"},
    },
    "required": ["title", "category", "year", "keywords", "published"],
    "additionalProperties": False,
}
TARGETS = {"tiny": 0.75, "small": 0.90}  # constrained / unconstrained throughput


def _prompts(n: int) -> list[str]:
    rng = random.Random(0)
    words = ["batch", "model", "stream", "worker", "token", "cache", "prompt", "row", "file",
             "queue", "result", "page"]  # fmt: skip
    return [
        f"Document {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
        for i in range(n)
    ]


def child(size: str, n: int) -> dict:
    importlib.import_module("batchgen")  # before torch: its OpenMP spin, as the worker has
    import torch

    from batchgen import Engine, SamplingParams, StructuredOutput
    from batchgen.toy import write_toy_checkpoint

    with tempfile.TemporaryDirectory(prefix="bg-structured-bench-") as tmp:
        model = write_toy_checkpoint(Path(tmp), arch="llama", size=size)
        # no prefix cache: the second run would skip the prompts the first one computed
        engine = Engine.from_pretrained(model, max_num_seqs=n, enable_prefix_caching=False)
    prompts = _prompts(n)
    constrained = SamplingParams(max_tokens=256, structured_output=StructuredOutput(json=SCHEMA))
    with torch.inference_mode():
        engine.generate(prompts[:8], constrained)  # warm: compile the grammar, the tokenizer
        masks = engine.runner.masks
        masks.fill_seconds = masks.wait_seconds = 0.0
        start = time.perf_counter()
        outs = engine.generate(prompts, constrained)
        constrained_s = time.perf_counter() - start
        fill_s, wait_s = masks.fill_seconds, masks.wait_seconds
        lengths = [len(o.token_ids) for o in outs]
        free = [SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths]
        engine.generate(prompts[:8], free[:8])
        start = time.perf_counter()
        free_outs = engine.generate(prompts, free)
        free_s = time.perf_counter() - start
    assert [len(o.token_ids) for o in free_outs] == lengths
    stopped = [o for o in outs if o.finish_reason == "stop"]
    valid = 0
    for o in stopped:
        try:
            value = json.loads(o.text)
        except ValueError:
            continue
        valid += isinstance(value, dict) and set(value) == set(SCHEMA["properties"])
    tokens = sum(lengths)
    return {
        "size": size,
        "requests": n,
        "output_tokens": tokens,
        "stopped": len(stopped),
        "valid_json": valid,
        "constrained_tok_s": tokens / constrained_s,
        "unconstrained_tok_s": tokens / free_s,
        "ratio": free_s / constrained_s,
        "target": TARGETS[size],
        "mask_fill_share": fill_s / constrained_s,
        "mask_wait_share": wait_s / constrained_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.requests)))
        return
    results = []
    for size in [s for _ in range(args.rounds) for s in args.sizes.split(",")]:
        out = subprocess.run(
            [sys.executable, __file__, "--child", size, "--requests", str(args.requests)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"schema": SCHEMA, "results": results}, indent=2))
    print()
    header = ("size", "rows stop/valid", "constrained tok/s", "free tok/s", "ratio", "target",
              "mask fill", "mask wait")  # fmt: skip
    print(" | ".join(header))
    for r in results:
        print(" | ".join([
            r["size"], f"{r['stopped']}/{r['valid_json']} of {r['requests']}",
            f"{r['constrained_tok_s']:.0f}", f"{r['unconstrained_tok_s']:.0f}",
            f"{r['ratio']:.2f}", f"{r['target']:.2f}", f"{r['mask_fill_share']:.1%}",
            f"{r['mask_wait_share']:.1%}",
        ]))  # fmt: skip


if __name__ == "__main__":
    main()
