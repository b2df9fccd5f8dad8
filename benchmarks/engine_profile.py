"""Where a batchgen engine run spends its time, by part of the step.

    python benchmarks/engine_profile.py --model DIR          # the "mixed" workload, 64 requests

Runs the workload once under torch.profiler with labels around the step's
parts (input preparation, model forward, decode/prefill attention, logits,
sampling), and counts decode steps by batch size. Prints JSON, then a table.
Profiling slows the run down; read shares, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PARTS = {
    "prepare": ("batchgen.worker.engine.runner.model_runner", "ModelRunner", "prepare"),
    "forward": ("batchgen.worker.models.decoder", "Decoder", "forward"),
    "attention": ("batchgen.kernels.cpu.attention", "CpuAttention", "__call__"),
    "logits": ("batchgen.worker.models.decoder", "Decoder", "compute_logits"),
    "sampling": ("batchgen.worker.engine.runner.sampler", "Sampler", "__call__"),
}
BATCH_BUCKETS = (("1-7", 1, 7), ("8-16", 8, 16), ("17-32", 17, 32), ("33-64", 33, 64),
                 ("65+", 65, 1 << 30))  # fmt: skip
# the packed fp32 projections (worker/models/weights.py), the rest of the products, the
# prefill attention (SDPA; with GQA or a mask torch takes its math path)
OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::scaled_dot_product_attention",
       "aten::index_select")  # fmt: skip


def _label(owner: Any, name: str, label: str) -> None:
    from torch.profiler import record_function

    inner: Callable[..., Any] = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return inner(*args, **kwargs)

    setattr(owner, name, wrapped)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory (batchgen toy-model)")
    p.add_argument("--workload", default="mixed")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", default=None, help="the engine's dtype (default: float32 on CPU)")
    p.add_argument("--vocab", type=int, default=None, help="ids drawn below (engine_bench's)")
    args = p.parse_args()

    import importlib

    importlib.import_module("batchgen")  # before torch: its OpenMP spin, as the worker has
    import torch
    from torch.profiler import profile

    from batchgen import Engine, SamplingParams
    from batchgen.worker.engine.runner.model_runner import ModelRunner
    from benchmarks.workloads import WORKLOADS

    engine = Engine.from_pretrained(args.model, dtype=args.dtype)
    # the same ids as engine_bench.py, which draws them below the tokenizer's vocabulary
    vocab = args.vocab or engine.runner.model.config.vocab_size
    torch.manual_seed(0)
    wl = WORKLOADS[args.workload](args.num_requests, vocab)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.max_tokens]
    engine.generate(wl.prompts[:4], params[:4])  # warm-up
    if engine.block_manager.enable_prefix_caching:
        engine.block_manager.cached.clear()  # no hits from the warm-up, as engine_bench.py
    for label, (module, cls, name) in PARTS.items():
        mod = importlib.import_module(module)
        _label(getattr(mod, cls) if cls else mod, name, label)

    batches: Counter[int] = Counter()
    run = ModelRunner.run

    def counting_run(self: ModelRunner, plan: Any) -> Any:
        if not plan.prefills:
            batches[len(plan.decodes)] += 1
        return run(self, plan)

    ModelRunner.run = counting_run  # type: ignore[method-assign]
    with profile() as prof:
        start = time.perf_counter()
        outputs = engine.generate(wl.prompts, params)
        wall = time.perf_counter() - start
    totals = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
    steps = sum(batches.values())
    report = {
        "model": args.model,
        "workload": args.workload,
        "requests": args.num_requests,
        "dtype": args.dtype or "float32",
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "wall_s_profiled": round(wall, 2),
        "parts_s": {k: round(totals.get(k, 0.0), 3) for k in PARTS},
        "ops_s": {k: round(totals.get(k, 0.0), 3) for k in OPS},
        "decode_steps": steps,
        "decode_steps_by_batch": {
            label: sum(n for b, n in batches.items() if lo <= b <= hi)
            for label, lo, hi in BATCH_BUCKETS
        },
    }
    print(json.dumps(report))
    print(f"\n{'part':<52}{'seconds':>10}{'share of wall':>16}")
    for name, secs in [*report["parts_s"].items(), *report["ops_s"].items()]:
        print(f"{name:<52}{secs:>10.3f}{secs / wall:>15.0%}")
    print(f"\ndecode steps by batch size: {report['decode_steps_by_batch']}")


if __name__ == "__main__":
    main()
