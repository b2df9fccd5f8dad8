"""Embedding throughput: batchgen's engine against an HF forward with the same pooling.

    python benchmarks/embed_bench.py                       # tiny (N=128) and small (N=32)
    python benchmarks/embed_bench.py --sizes tiny --poolings last,mean

Workload (seeded): random token ids, lengths uniform 16..256. batchgen embeds
the list with ``Engine.embed`` (paged prefill, no decode, pooling per step);
HF runs ``AutoModel`` on batches of --hf-batch inputs in input order, right
padded with an attention mask, and pools ``last_hidden_state`` the same way
(last real token or masked mean, then L2-normalize). Both run in this process
under inference mode, fp32 on the CPU, after one warm-up call each, best of
--repeats timed runs; the
vectors of the two are compared (max abs difference). The load average
(``os.getloadavg``) is printed with the figures: on a shared machine they
measure the neighbours too. Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# both systems' OpenMP threads sleep while they wait (batchgen's engine sets this itself
# when imported before torch: worker/cpu_threads.py); HF gets it too, to compare the models
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {"tiny": 128, "small": 32}  # inputs per size
VOCAB = {"tiny": 8192, "small": 32000}
ST_MODES = {"mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken"}


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]


def with_pooling(src: Path, out: Path, mode: str) -> Path:
    """``src`` linked, plus a sentence-transformers config: ``mode`` pooling, Normalize."""
    if out.exists():
        return out
    out.mkdir(parents=True)
    for f in src.iterdir():
        (out / f.name).symlink_to(f)
    st = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": st + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": st + "Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": st + "Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({ST_MODES[mode]: True}))
    return out


def best_of(repeats: int, fn: Any) -> tuple[float, Any]:
    """The fastest of ``repeats`` timed calls, and its result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run_batchgen(path: Path, inputs: list[list[int]], repeats: int) -> tuple[float, Any]:
    import torch

    from batchgen import Engine

    # no prefix cache: a repeat would otherwise find last-token inputs' blocks cached
    engine = Engine.from_pretrained(path, num_kv_blocks=2048, enable_prefix_caching=False)
    engine.embed(inputs[:2])  # warm-up: kernels compiled, buffers allocated
    secs, vectors = best_of(repeats, lambda: engine.embed(inputs))
    return secs, torch.tensor(vectors)


def run_hf(
    path: Path, inputs: list[list[int]], mode: str, batch: int, repeats: int
) -> tuple[float, Any]:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def embed(chunk: list[list[int]]) -> torch.Tensor:
        longest = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for i, x in enumerate(chunk):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        lens = mask.sum(dim=1)
        if mode == "mean":
            pooled = (hidden * mask.unsqueeze(-1)).sum(dim=1) / lens.unsqueeze(-1)
        else:
            pooled = hidden[torch.arange(len(chunk)), lens - 1]
        return torch.nn.functional.normalize(pooled, dim=-1)

    with torch.inference_mode():
        embed(inputs[:2])
        secs, out = best_of(
            repeats, lambda: [embed(inputs[i : i + batch]) for i in range(0, len(inputs), batch)]
        )
        return secs, torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--poolings", default="last,mean")
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timed runs")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep checkpoints here")
    args = parser.parse_args()

    import torch

    from batchgen.toy import write_toy_checkpoint

    torch.manual_seed(0)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="embed-bench-"))
    results = []
    for size in args.sizes.split(","):
        base = work / f"llama-{size}"
        if not (base / "config.json").exists():
            write_toy_checkpoint(base, arch="llama", size=size)
        inputs = workload(SIZES[size], VOCAB[size])
        tokens = sum(len(x) for x in inputs)
        for mode in args.poolings.split(","):
            path = with_pooling(base, work / f"llama-{size}-{mode}", mode)
            load_before = os.getloadavg()[0]
            bg_s, bg_vec = run_batchgen(path, inputs, args.repeats)
            hf_s, hf_vec = run_hf(base, inputs, mode, args.hf_batch, args.repeats)
            diff = float((bg_vec - hf_vec).abs().max())
            for system, secs in (("batchgen", bg_s), (f"hf-batch{args.hf_batch}", hf_s)):
                results.append({
                    "size": size, "pooling": mode, "system": system, "inputs": len(inputs),
                    "tokens": tokens, "wall_s": round(secs, 3),
                    "inputs_per_s": round(len(inputs) / secs, 1),
                    "tokens_per_s": round(tokens / secs, 1),
                    "max_abs_diff_vs_other": diff,
                    "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                })  # fmt: skip
    print(json.dumps(results, indent=1))
    head = f"{'size':6} {'pooling':7} {'system':12} {'inputs/s':>9} {'tokens/s':>9} {'load':>11}"
    print(head)
    for r in results:
        load = "{}-{}".format(*r["loadavg_1m"])
        print(
            f"{r['size']:6} {r['pooling']:7} {r['system']:12} {r['inputs_per_s']:9.1f} "
            f"{r['tokens_per_s']:9.1f} {load:>11}"
        )


if __name__ == "__main__":
    main()
