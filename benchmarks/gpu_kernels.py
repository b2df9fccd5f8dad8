"""gpu_check sections 1 and 2: Triton kernels against their oracles, and
paged decode attention's bandwidth against the device's copy bandwidth."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from benchmarks.gpu_bench import TARGET_FRACTION, Bench, compare


def correctness(b: Bench) -> dict[str, Any]:
    from batchgen.kernels import dense
    from batchgen.kernels import reference as ref
    from batchgen.kernels.triton.decode_attention import decode_attention
    from batchgen.kernels.triton.latent_decode import latent_decode_attention
    from batchgen.kernels.triton.op_set import TRITON_OPS as ops

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
        return compare(out, dense.paged_decode_attention(*args))

    def latent_decode(num_splits: int | None):
        """DeepSeek's MLA: one latent row per token as K and V for every head."""
        heads, rank, rope = s.mla
        contexts = list(s.decode_contexts)
        cache, _, tables, lens = b.paged(contexts, rank + rope)
        cache = cache[:, :, :1]  # one row per token (a strided view of the pool)
        q = b.randn(len(contexts), heads, rank + rope)
        args = (q, cache, tables, lens, (rank + rope) ** -0.5, max(contexts))
        out = latent_decode_attention(*args, num_splits=num_splits)
        expected = dense.paged_decode_attention(q, cache, cache, *args[2:])
        return compare(out, expected)

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
        return compare(ops.paged_prefill_attention(*args), dense.paged_prefill_attention(*args))

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
        return compare(out, dense.paged_decode_attention(*args))

    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "decode_cuda_graph": decode_cuda_graph,
        "store_kv": store_kv,
        "decode": lambda: decode(s.head_dim, None),
        "decode_no_split": lambda: decode(s.head_dim, 1),
        "decode_8_splits": lambda: decode(s.head_dim, 8),
        "decode_head_dim_80": lambda: decode(80, 4),
        "mla_decode": lambda: latent_decode(None),
        "mla_decode_8_splits": lambda: latent_decode(8),
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
        "mla_decode": mla_bandwidth(b, copy_bw),
        "copy_gb_per_s": copy_bw / 1e9,
        "decode": rows,
        "target_shape_sweep": sweep,
        "target": f">= {TARGET_FRACTION:.0%} of copy bandwidth at (batch, context) {s.bw_target}",
        "target_met": bool(target) and target[0]["fraction_of_copy"] >= TARGET_FRACTION,
    }


def mla_bandwidth(b: Bench, copy_bw: float) -> dict[str, Any]:
    """The MLA decode kernel at the target (batch, context): latent bytes read / time."""
    from batchgen.kernels.triton.latent_decode import latent_decode_attention

    torch, s = b.torch, b.shapes
    (batch, ctx), (heads, rank, rope) = s.bw_target, s.mla
    nb = -(-ctx // s.block_size)
    cache = b.randn(batch * nb, s.block_size, 1, rank + rope)
    perm = torch.randperm(batch * nb, generator=b.gen, device=b.device)
    tables = perm.view(batch, nb).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=b.device)
    q = b.randn(batch, heads, rank + rope)
    args = (q, cache, tables, lens, (rank + rope) ** -0.5, ctx)
    seconds = b.median_seconds(functools.partial(latent_decode_attention, *args))
    latent_bytes = batch * ctx * (rank + rope) * cache.element_size()
    return {
        "batch": batch, "context": ctx, "heads": heads, "ms": seconds * 1e3,
        "gb_per_s": latent_bytes / seconds / 1e9, "fraction_of_copy": latent_bytes / seconds / copy_bw,
    }  # fmt: skip
