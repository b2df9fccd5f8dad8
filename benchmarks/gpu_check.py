"""GPU check for the Triton kernels: correctness, decode bandwidth, engine tok/s.

    python benchmarks/gpu_check.py [--out result.json]   # one GPU, < 5 minutes
    python benchmarks/gpu_check.py --dry-run              # CPU, Triton interpreter, tiny shapes

Needs only torch, triton, transformers and safetensors: the repository root is
put on sys.path, and its ``batchgen/`` folder (symlinks to ``kernels/``,
``worker/``, ``jobs/``) makes ``import batchgen.kernels`` work uninstalled.
Prints a short table on stderr and the JSON result on stdout. Sections:

1. correctness: every Triton op against its reference on the device (bf16,
   realistic shapes): max abs error and pass/fail.
2. bandwidth: paged decode attention's K/V bytes read / time against the
   device's copy bandwidth ((read + written bytes) / time of a big
   device-to-device copy), batch 64/128/256 x context 512/2k/8k, Llama-3-8B
   attention (32 heads, 8 KV heads, head_dim 128). Target: >= 70% at 128 x 2k.
3. engine: output tok/s of batchgen's engine against HF transformers'
   continuous batching on a random Llama-3.2-1B-shaped bf16 checkpoint.

An exception inside a section (or a case) is reported in the JSON and the
script goes on.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_contexts: tuple[int, ...]
    prefill_chunks: tuple[tuple[int, int], ...]  # (context_len, q_len) per sequence
    tokens: int  # rows for norm / rotary / activation / store_kv
    hidden: int
    intermediate: int
    bw_batches: tuple[int, ...]
    bw_contexts: tuple[int, ...]
    bw_target: tuple[int, int]  # (batch, context) held to TARGET_FRACTION
    copy_bytes: int
    warmup: int
    iters: int
    num_prompts: int  # engine workload
    prompt_lens: tuple[int, int]
    max_new_tokens: int


GPU = Shapes(
    32, 8, 128, 16,
    decode_contexts=(1, 17, 100, 511, 1024, 2048, 4097, 8000) * 8,
    prefill_chunks=((512, 512), (2048, 512), (1000, 1), (4096, 37), (17, 17), (300, 299)),
    tokens=4096, hidden=4096, intermediate=14336,
    bw_batches=(64, 128, 256), bw_contexts=(512, 2048, 8192), bw_target=(128, 2048),
    copy_bytes=4 << 30, warmup=3, iters=10,
    num_prompts=256, prompt_lens=(64, 512), max_new_tokens=256,
)  # fmt: skip
DRY_RUN = Shapes(
    4, 2, 16, 16,
    decode_contexts=(1, 17, 40),
    prefill_chunks=((20, 20), (33, 5), (17, 1)),
    tokens=4, hidden=32, intermediate=48,
    bw_batches=(2,), bw_contexts=(17, 40), bw_target=(2, 40),
    copy_bytes=1 << 20, warmup=1, iters=2,
    num_prompts=4, prompt_lens=(4, 16), max_new_tokens=4,
)  # fmt: skip
TARGET_FRACTION = 0.7  # of copy bandwidth, at batch 128, context 2048
TARGET_SPEEDUP = 3.0  # engine over HF continuous batching
TOLERANCE = {"bfloat16": (3e-2, 2e-2), "float16": (3e-3, 3e-3), "float32": (1e-4, 1e-4)}


class Bench:
    """Tensors on one device and a median timer (CUDA events on a GPU)."""

    def __init__(self, shapes: Shapes, device: str):
        import torch

        self.torch = torch
        self.shapes = shapes
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(0)

    def randn(self, *shape: int, dtype: Any = None) -> Any:
        dtype = dtype or self.torch.bfloat16
        return self.torch.randn(*shape, generator=self.gen, device=self.device).to(dtype)

    def paged(self, contexts, head_dim: int, dtype: Any = None):
        """Random caches, shuffled block tables and context_lens for ``contexts``."""
        torch, bs = self.torch, self.shapes.block_size
        need = [-(-c // bs) for c in contexts]
        width = max(need)
        k_cache = self.randn(sum(need) + 1, bs, self.shapes.num_kv_heads, head_dim, dtype=dtype)
        v_cache = self.randn(*k_cache.shape, dtype=dtype)
        perm = torch.randperm(k_cache.shape[0], generator=self.gen, device=self.device)
        tables = torch.zeros(len(contexts), width, dtype=torch.int32, device=self.device)
        start = 0
        for i, n in enumerate(need):
            tables[i, :n] = perm[start : start + n]
            tables[i, n:] = perm[start + n - 1]
            start += n
        lens = torch.tensor(contexts, dtype=torch.int32, device=self.device)
        return k_cache, v_cache, tables, lens

    def median_seconds(self, fn: Callable[[], Any]) -> float:
        torch = self.torch
        for _ in range(self.shapes.warmup):
            fn()
        times = []
        for _ in range(self.shapes.iters):
            if self.device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def compare(out: Any, expected: Any, dtype: str = "bfloat16") -> dict[str, Any]:
    atol, rtol = TOLERANCE[dtype]
    diff = (out.float() - expected.float()).abs()
    ok = bool((diff <= atol + rtol * expected.float().abs()).all())
    return {"max_abs_err": float(diff.max()) if diff.numel() else 0.0, "pass": ok}


def correctness(b: Bench) -> dict[str, Any]:
    from batchgen.kernels import reference as ref
    from batchgen.kernels.triton import TRITON_OPS as ops
    from batchgen.kernels.triton.decode_attention import decode_attention

    torch, s = b.torch, b.shapes
    hq, hk = s.num_heads, s.num_kv_heads

    def store_kv():
        k_cache, v_cache, _, _ = b.paged([s.tokens * 2], s.head_dim)
        key, value = b.randn(s.tokens, hk, s.head_dim), b.randn(s.tokens, hk, s.head_dim)
        slots = torch.randperm(k_cache.shape[0] * s.block_size, device=b.device)[: s.tokens]
        slots[::7] = ref.PAD_SLOT_ID
        expected = k_cache.clone(), v_cache.clone()
        ref.store_kv(key, value, *expected, slots)
        ops.store_kv(key, value, k_cache, v_cache, slots)
        exact = torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])
        return {**compare(k_cache, expected[0]), "pass": exact}

    def decode(head_dim: int, num_splits: int | None):
        contexts = list(s.decode_contexts)
        k_cache, v_cache, tables, lens = b.paged(contexts, head_dim)
        q = b.randn(len(contexts), hq, head_dim)
        args = (q, k_cache, v_cache, tables, lens, head_dim**-0.5, max(contexts))
        out = decode_attention(*args, num_splits=num_splits)
        return compare(out, ref.paged_decode_attention(*args))

    def prefill(head_dim: int):
        contexts = [c for c, _ in s.prefill_chunks]
        q_lens = [n for _, n in s.prefill_chunks]
        k_cache, v_cache, tables, lens = b.paged(contexts, head_dim)
        starts = torch.tensor([0, *q_lens], device=b.device).cumsum(0).to(torch.int32)
        q = b.randn(sum(q_lens), hq, head_dim)
        args = (
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            starts,
            head_dim**-0.5,
            max(q_lens),
            max(contexts),
        )
        return compare(ops.paged_prefill_attention(*args), ref.paged_prefill_attention(*args))

    def norms():
        x, res = b.randn(s.tokens, s.hidden), b.randn(s.tokens, s.hidden)
        w = b.randn(s.hidden).abs() + 0.5
        got, expected = (
            ops.fused_add_rms_norm(x, res, w, 1e-5),
            ref.fused_add_rms_norm(x, res, w, 1e-5),
        )
        plain = compare(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
        fused, summed = compare(got[0], expected[0]), compare(got[1], expected[1])
        return {"rms_norm": plain, "fused_add_rms_norm": fused, "fused_add_residual": summed}

    def rotary():
        qkv = b.randn(s.tokens, (hq + 2 * hk) * s.head_dim)
        q = qkv[:, : hq * s.head_dim].view(s.tokens, hq, s.head_dim)
        k = qkv[:, hq * s.head_dim : (hq + hk) * s.head_dim].view(s.tokens, hk, s.head_dim)
        inv = 1.0 / 500000.0 ** (torch.arange(0, s.head_dim, 2, device=b.device) / s.head_dim)
        freqs = torch.arange(8192, device=b.device)[:, None] * inv[None, :]
        pos = torch.randint(0, 8192, (s.tokens,), generator=b.gen, device=b.device)
        args = (q, k, pos, freqs.cos(), freqs.sin())
        (q1, k1), (q2, k2) = ops.apply_rotary(*args), ref.apply_rotary(*args)
        return {"q": compare(q1, q2), "k": compare(k1, k2)}

    def decode_cuda_graph():
        """Captured once, replayed after the inputs changed in place (longer contexts too)."""
        if b.device.type != "cuda":
            return {"pass": True, "skipped": "needs CUDA"}
        contexts = list(s.decode_contexts)
        k_cache, v_cache, tables, lens = b.paged(contexts, s.head_dim)
        q = b.randn(len(contexts), hq, s.head_dim)
        args = (q, k_cache, v_cache, tables, lens, s.head_dim**-0.5, max(contexts))
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            ops.paged_decode_attention(*args)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.paged_decode_attention(*args)
        q.copy_(b.randn(*q.shape))
        lens.copy_(lens.flip(0))
        tables.copy_(tables.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        return compare(out, ref.paged_decode_attention(*args))

    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "decode_cuda_graph": decode_cuda_graph,
        "store_kv": store_kv,
        "decode": lambda: decode(s.head_dim, None),
        "decode_no_split": lambda: decode(s.head_dim, 1),
        "decode_8_splits": lambda: decode(s.head_dim, 8),
        "decode_head_dim_80": lambda: decode(80, 4),
        "prefill": lambda: prefill(s.head_dim),
        "prefill_head_dim_80": lambda: prefill(80),
        "norms": norms,
        "apply_rotary": rotary,
        "silu_and_mul": lambda: (lambda x: compare(ops.silu_and_mul(x), ref.silu_and_mul(x)))(
            b.randn(s.tokens, 2 * s.intermediate)
        ),
    }
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception as exc:  # report and go on with the next case
            results[name] = {"pass": False, "error": repr(exc)}
    # a case is one check ({"pass": ...}) or a dict of named checks
    checks = [c for r in results.values() for c in ([r] if "pass" in r else r.values())]
    results["all_pass"] = all(c.get("pass") for c in checks)
    return results


def copy_bandwidth(b: Bench) -> float:
    """(bytes read + bytes written) per second of one big device-to-device copy."""
    src = b.torch.empty(b.shapes.copy_bytes // 2, dtype=b.torch.bfloat16, device=b.device)
    dst = b.torch.empty_like(src)
    return 2 * b.shapes.copy_bytes / b.median_seconds(lambda: dst.copy_(src))


def bandwidth(b: Bench) -> dict[str, Any]:
    from batchgen.kernels.triton.decode_attention import decode_attention
    from batchgen.kernels.triton.split_k import choose_num_splits, num_sms

    torch, s = b.torch, b.shapes
    copy_bw = copy_bandwidth(b)

    # one pool big enough for the largest case; each case shuffles its blocks
    max_blocks = max(s.bw_batches) * -(-max(s.bw_contexts) // s.block_size)
    k_cache = torch.empty(
        max_blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=torch.bfloat16, device=b.device
    )
    k_cache.normal_(generator=b.gen)
    v_cache = torch.empty_like(k_cache).normal_(generator=b.gen)

    def case(batch: int, ctx: int) -> tuple[tuple[Any, ...], int]:
        """Decode arguments over shuffled blocks of the pool, and their K/V bytes."""
        nb = -(-ctx // s.block_size)
        perm = torch.randperm(max_blocks, generator=b.gen, device=b.device)
        tables = perm[: batch * nb].view(batch, nb).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=b.device)
        q = b.randn(batch, s.num_heads, s.head_dim)
        kv_bytes = 2 * batch * ctx * s.num_kv_heads * s.head_dim * k_cache.element_size()
        return (q, k_cache, v_cache, tables, lens, s.head_dim**-0.5, ctx), kv_bytes

    rows = []
    for batch in s.bw_batches:
        for ctx in s.bw_contexts:
            args, kv_bytes = case(batch, ctx)
            seconds = b.median_seconds(functools.partial(decode_attention, *args))
            splits = choose_num_splits(batch, s.num_kv_heads, ctx, num_sms(b.device))
            rows.append({
                "batch": batch, "context": ctx, "num_splits": splits, "ms": seconds * 1e3,
                "gb_per_s": kv_bytes / seconds / 1e9, "fraction_of_copy": kv_bytes / seconds / copy_bw,
            })  # fmt: skip
    # launch choices at the target shape, to tune the defaults from one run
    args, kv_bytes = case(*s.bw_target)
    variants: list[dict[str, Any]] = [
        {"tile_size": t, "num_warps": w} for t in (32, 64, 128) for w in (4, 8)
    ]
    variants += [{"num_splits": n} for n in (1, 2, 4)]
    sweep = []
    for variant in variants:
        seconds = b.median_seconds(functools.partial(decode_attention, *args, **variant))
        sweep.append(
            {**variant, "ms": seconds * 1e3, "fraction_of_copy": kv_bytes / seconds / copy_bw}
        )
    target = [r for r in rows if (r["batch"], r["context"]) == s.bw_target]
    return {
        "copy_gb_per_s": copy_bw / 1e9,
        "decode": rows,
        "target_shape_sweep": sweep,
        "target": f">= {TARGET_FRACTION:.0%} of copy bandwidth at (batch, context) {s.bw_target}",
        "target_met": bool(target) and target[0]["fraction_of_copy"] >= TARGET_FRACTION,
    }


def engine(b: Bench) -> dict[str, Any]:
    try:
        from batchgen.worker import Engine  # noqa: F401  (the engine issue's entry point)
    except ImportError as exc:
        return {"engine": "not available on this branch", "reason": repr(exc)}
    from batchgen.toy import write_toy_checkpoint
    from batchgen.toy.checkpoint import ToySize

    s = b.shapes
    # Llama-3.2-1B's shape (head_dim 64, tied embeddings); a small tokenizer is
    # enough since prompts are random token ids.
    size = ToySize(2048, 16, 32, 8, 8192, 128256, 8192, tokenizer_vocab_size=8192)
    if s is DRY_RUN:
        size = ToySize(64, 2, 4, 2, 128, 512, 1024, tokenizer_vocab_size=512)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_toy_checkpoint(tmp, arch="llama", size=size, dtype="bfloat16")
        gen = b.torch.Generator().manual_seed(0)
        lens = b.torch.randint(*s.prompt_lens, (s.num_prompts,), generator=gen).tolist()
        vocab = size.tokenizer_vocab_size or size.vocab_size
        prompts = [b.torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
        hf = hf_continuous_batching(model_dir, prompts, s.max_new_tokens, b.device)
        ours = engine_throughput(model_dir, prompts, s.max_new_tokens, b.device)
    return {
        "hf_continuous_batching": hf,
        "engine": ours,
        "speedup": ours["output_tok_s"] / hf["output_tok_s"],
        "target_met": ours["output_tok_s"] >= TARGET_SPEEDUP * hf["output_tok_s"],
    }


def hf_continuous_batching(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: Any
) -> dict[str, Any]:
    """HF transformers' generate_batch on the workload: greedy, EOS ignored.

    generate_batch warms up (captures CUDA graphs) inside every call, before it
    admits the requests, so the rate is measured from the first request's
    creation to the last one's end, not over the whole call.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    model.generate_batch(inputs=prompts[:4], generation_config=config)  # compile, allocate
    t0 = time.perf_counter()
    outputs = list(model.generate_batch(inputs=prompts, generation_config=config).values())
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in outputs)
    window = max(o.lifespan[1] for o in outputs) - min(o.created_time for o in outputs)
    errors = [o.error for o in outputs if o.error is not None]
    return {
        "requests": len(outputs), "errors": errors[:3], "output_tokens": tokens,
        "seconds": window, "wall_seconds": wall, "output_tok_s": tokens / window,
    }  # fmt: skip


def engine_throughput(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: Any
) -> dict[str, Any]:
    """batchgen's engine on the same workload: greedy, EOS ignored, bf16, Triton
    kernels and CUDA-graph decode on a GPU (the references on the dry run)."""
    import torch

    from batchgen.worker import Engine, SamplingParams

    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()  # the HF peer's weights and cache are gone by now
    t_load = time.perf_counter()
    engine = Engine.from_pretrained(
        model_dir, device=str(device), dtype="bfloat16", max_num_seqs=256,
        num_kv_blocks=None if str(device).startswith("cuda") else 256,
    )  # fmt: skip
    load_s = time.perf_counter() - t_load
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    engine.generate(prompts[:4], params)  # compile the kernels outside the timing
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = engine.stats()
    return {
        "requests": len(outputs), "output_tokens": tokens, "seconds": wall,
        "output_tok_s": tokens / wall, "load_seconds": load_s, "ops": engine.runner.model.ops.name,
        "cuda_graphs": engine.runner.graphs is not None, "num_kv_blocks": engine.limits.num_kv_blocks,
        "steps": stats.num_steps, "preemptions": stats.num_preemptions,
    }  # fmt: skip


SECTIONS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "correctness": correctness,
    "bandwidth": bandwidth,
    "engine": engine,
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
    for name, section in result["sections"].items():
        if "error" in section:
            lines.append(f"  {name}: ERROR {section['error']}")
    if "engine" in result["sections"]:
        lines.append(f"  engine: {json.dumps(result['sections']['engine'])[:200]}")
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
