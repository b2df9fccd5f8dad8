"""What tensor parallelism costs on the CPU: N ranks of 1 thread against 1 rank of N threads.

    python -m benchmarks.tensor_parallel_cpu [--size small] [--ranks 2] [--prompts 8]

Builds a toy Llama checkpoint of ``--size`` (cached under the temp dir), then
generates the same greedy batch with ``tensor_parallel_size=1, threads=N`` and
``tensor_parallel_size=N, threads=1``, and prints each one's load time, step time
and tokens/s, and whether their tokens agree. On the CPU tensor parallelism is a
correctness path (how the tests run the split), not a speed-up: each layer's two
all-reduces and the logits' all-gather go through gloo over loopback TCP.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from batchgen import Engine, SamplingParams
from batchgen.toy import write_toy_checkpoint


def run(path: Path, ranks: int, threads: int, prompts: list[list[int]], tokens: int) -> dict:
    started = time.perf_counter()
    engine = Engine.from_pretrained(
        path, tensor_parallel_size=ranks, threads=threads, num_kv_blocks=256
    )
    loaded = time.perf_counter() - started
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # first-call packing
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    took = time.perf_counter() - started
    steps = engine.stats().num_steps
    engine.close()
    generated = sum(len(o.token_ids) for o in outputs)
    return {
        "load_s": loaded,
        "generate_s": took,
        "tok_s": generated / took,
        "ms_per_step": 1000 * took / max(steps, 1),
        "tokens": [list(o.token_ids) for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    path = Path(tempfile.gettempdir()) / f"batchgen-tp-bench-llama-{args.size}"
    if not (path / "config.json").exists():
        write_toy_checkpoint(path, arch="llama", size=args.size)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(32)] for i in range(args.prompts)]
    one = run(path, 1, args.ranks, prompts, args.tokens)
    split = run(path, args.ranks, 1, prompts, args.tokens)
    for name, r in ((f"1 rank x {args.ranks} threads", one),
                    (f"{args.ranks} ranks x 1 thread", split)):  # fmt: skip
        print(f"{name:>20}: load {r['load_s']:.1f} s, generate {r['generate_s']:.2f} s, "
              f"{r['tok_s']:.1f} tok/s, {r['ms_per_step']:.1f} ms/step")  # fmt: skip
    print("same tokens:", one["tokens"] == split["tokens"])


if __name__ == "__main__":
    main()
