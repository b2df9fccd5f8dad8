"""The CPU path against the plain versions: attention against ``dense.py`` (itself
checked against a loop over heads and positions), the other ops against naive math."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from batchgen.kernels import dense
from batchgen.kernels import reference as ref
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import decode as cpu_decode
from batchgen.kernels.cpu import elementwise as cpu_elementwise
from batchgen.kernels.cpu import native as cpu_native
from batchgen.kernels.cpu.decode_native import KernelDecode


def attention_by_loops(q, k, v, scale, window=None, softcap=None):
    """q (q_len, H, D) at the last q_len positions of k/v (ctx, Hk, D), causal, one score
    at a time; window: a query at p sees keys p - window < j <= p; softcap: scores ->
    softcap * tanh(scores / softcap)."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for t in range(q_len):
        pos = ctx - q_len + t
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(num_heads):
            s = (k[lo : pos + 1, h // group] @ q[t, h]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[t, h] = torch.softmax(s, dim=0) @ v[lo : pos + 1, h // group]
    return out


@pytest.mark.parametrize("q_len,ctx", [(1, 1), (1, 40), (5, 5), (7, 30)])
def test_the_oracle_is_attention_by_loops(q_len, ctx):
    gen = torch.Generator().manual_seed(q_len * 100 + ctx)
    q = torch.randn(q_len, 6, 16, generator=gen)
    k, v = torch.randn(ctx, 2, 16, generator=gen), torch.randn(ctx, 2, 16, generator=gen)
    torch.testing.assert_close(dense.attend(q, k, v, 0.3), attention_by_loops(q, k, v, 0.3))


def _paged(contexts, num_kv_heads, head_dim, block_size, seed=0):
    """Random K/V for each sequence, scattered into shuffled blocks of a pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in contexts]
    total = sum(blocks_needed) + 3
    perm = torch.randperm(total, generator=gen).tolist()
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    width = max(blocks_needed)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32)
    rows_kv = []
    for i, (ctx, nb) in enumerate(zip(contexts, blocks_needed)):
        ids = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids)
        tables[i, nb:] = ids[-1]  # tail padded with the sequence's own last block
        k = k_cache[ids].flatten(0, 1)[:ctx]
        v = v_cache[ids].flatten(0, 1)[:ctx]
        rows_kv.append((k, v))
    return k_cache, v_cache, tables, rows_kv


def _dense_of(k_cache, v_cache, tables, contexts):
    """Each row's own K/V, read through its block table: [(k, v)] of (ctx, Hk, D)."""
    out = []
    for i, ctx in enumerate(contexts):
        ids = tables[i].long()
        out.append((k_cache[ids].flatten(0, 1)[:ctx], v_cache[ids].flatten(0, 1)[:ctx]))
    return out


def _assert_decode_rows_match_dense(out, q, rows_kv, scale):
    """Row i of a decode equals dense attention of q[i] over its own K/V."""
    for i, (k, v) in enumerate(rows_kv):
        expected = dense.attend(q[i : i + 1], k, v, scale)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def _decode(path, q, k_cache, v_cache, tables, contexts, scale):
    """The CPU decode of one layer along ``path`` ("kernel" or "torch"), proven to be taken."""
    if path == "kernel" and cpu_native._compiler() is None:
        pytest.skip("no C compiler on this machine: the torch path is the CPU path")
    lens = torch.tensor(contexts, dtype=torch.int32)
    plan = cpu_decode.plan_decode(tables, lens, k_cache, v_cache, use_kernel=path == "kernel")
    assert isinstance(plan, KernelDecode if path == "kernel" else cpu_decode.TorchDecode)
    return plan(q, k_cache, v_cache, scale)


PATHS = ["kernel", "torch"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_dense(path, num_heads, num_kv_heads, block_size):
    contexts = [70, 33, 17, 16, 15, 1]  # longest first, as the scheduler orders decodes
    head_dim = 32
    k_cache, v_cache, tables, rows_kv = _paged(contexts, num_kv_heads, head_dim, block_size)
    # q as the engine passes it: a view of the fused q/k/v projection
    qkv = torch.randn(len(contexts), (num_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_heads * head_dim].view(len(contexts), num_heads, head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = _decode(path, q, k_cache, v_cache, tables, contexts, scale)
    _assert_decode_rows_match_dense(out, q, rows_kv, scale)


def test_paged_decode_attention_takes_the_kernel_for_fp32_and_bf16():
    if cpu_native._compiler() is None:
        pytest.skip("no C compiler on this machine: the torch path is the CPU path")
    contexts = [40, 17, 3]
    k_cache, v_cache, tables, rows_kv = _paged(contexts, 2, 16, 16, seed=4)
    q = torch.randn(3, 4, 16)
    lens = torch.tensor(contexts, dtype=torch.int32)
    out = cpu_decode.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 40)
    _assert_decode_rows_match_dense(out, q, rows_kv, 0.25)
    halves = (q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())
    plan = cpu_decode.plan_decode(tables, lens, *halves[1:])
    assert isinstance(plan, KernelDecode)
    half = cpu_decode.paged_decode_attention(*halves, tables, lens, 0.25, 40)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), out, atol=3e-2, rtol=2e-2)


# The bf16 kernel sums in fp32 over bf16 K/V widened exactly: against the same sums in
# torch's fp32 (over the widened cache) only the order of the additions differs
BF16_KERNEL_ATOL = BF16_KERNEL_RTOL = 1e-5


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (14, 2), (8, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 30.0)])
def test_the_kernel_on_a_bf16_cache_is_fp32_attention_over_the_widened_cache(
    num_heads, num_kv_heads, window, softcap
):
    if cpu_native._compiler() is None:
        pytest.skip("no C compiler on this machine: the torch path is the CPU path")
    contexts = [70, 33, 17, 16, 15, 1]
    head_dim = 64
    k32, v32, tables, _ = _paged(contexts, num_kv_heads, head_dim, 16, seed=num_heads)
    k_cache, v_cache = k32.bfloat16(), v32.bfloat16()
    q = torch.randn(len(contexts), num_heads, head_dim)
    lens = torch.tensor(contexts, dtype=torch.int32)
    plan = cpu_decode.plan_decode(tables, lens, k_cache, v_cache, window=window, softcap=softcap)
    assert isinstance(plan, KernelDecode)
    scale = 1 / math.sqrt(head_dim)
    out = plan(q, k_cache, v_cache, scale)
    assert out.dtype == torch.float32
    widened = _dense_of(k_cache.float(), v_cache.float(), tables, contexts)
    for i, (k, v) in enumerate(widened):
        expected = attention_by_loops(q[i : i + 1], k, v, scale, window, softcap)
        torch.testing.assert_close(
            out[i : i + 1], expected, atol=BF16_KERNEL_ATOL, rtol=BF16_KERNEL_RTOL
        )
    # a bf16 query is widened exactly and the fp32 output rounded once, to bf16
    half = plan(q.bfloat16(), k_cache, v_cache, scale)
    assert torch.equal(half, plan(q.bfloat16().float(), k_cache, v_cache, scale).bfloat16())


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_the_kernel_splits_rows_over_threads_and_does_every_row(threads):
    """Rows of very different lengths (and a padding row) over 1..8 threads, more
    threads than rows too: every row equals the oracle (a row no thread took would
    hold whatever its fresh memory held)."""
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    contexts = [300, 1, 0, 45, 2, 120, 17]
    k_cache, v_cache, tables, rows_kv = _paged([max(c, 1) for c in contexts], 2, 32, 16, seed=9)
    lens = torch.tensor(contexts, dtype=torch.int32)
    plan = cpu_decode.plan_decode(tables, lens, k_cache, v_cache)
    assert isinstance(plan, KernelDecode)
    plan.threads = threads
    q = torch.randn(len(contexts), 4, 32)
    out = plan(q, k_cache, v_cache, 0.2)
    assert torch.equal(out[2], torch.zeros(4, 32))  # the padding row
    del contexts[2], rows_kv[2]
    _assert_decode_rows_match_dense(torch.cat([out[:2], out[3:]]), torch.cat([q[:2], q[3:]]),
                                    rows_kv, 0.2)  # fmt: skip


@pytest.mark.parametrize(
    "window,softcap,with_sinks", [(None, None, False), (24, None, False), (None, 30.0, True),
                                  (40, 50.0, True)],
)  # fmt: skip
def test_the_kernels_rows_are_the_same_bits_on_1_2_and_n_threads(window, softcap, with_sinks):
    """The pool hands each row to one thread, so every thread count gives the same bits,
    with sliding windows, soft-capping and sinks too, call after call (a step's layers
    reuse the pool); and they are attention: the torch path's, within fp32 rounding."""
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    contexts = [300, 1, 0, 45, 2, 120, 17, 64, 90]
    k_cache, v_cache, tables, _ = _paged([max(c, 1) for c in contexts], 2, 32, 16, seed=11)
    lens = torch.tensor(contexts, dtype=torch.int32)
    plan = cpu_decode.plan_decode(tables, lens, k_cache, v_cache, window=window, softcap=softcap)
    assert isinstance(plan, KernelDecode)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(contexts), 4, 32, generator=gen)
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    runs = {}
    for threads in (1, 2, 3, len(contexts), 16, 1):  # more threads than rows; 1 after the pool
        plan.threads = threads
        runs[threads] = [plan(q, k_cache, v_cache, 0.2, sinks) for _ in range(4)]
    one = runs[1][0]
    assert all(torch.equal(out, one) for outs in runs.values() for out in outs)
    by_torch = cpu_decode.plan_decode(
        tables, lens, k_cache, v_cache, use_kernel=False, window=window, softcap=softcap
    )
    torch.testing.assert_close(one, by_torch(q, k_cache, v_cache, 0.2, sinks), atol=1e-5, rtol=1e-5)


def test_a_step_with_enough_to_read_takes_torchs_threads():
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    k_cache, v_cache, tables, _ = _paged([512] * 8, 2, 64, 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # not 1, whatever share of the cores this process has
    try:
        many = cpu_decode.plan_decode(
            tables, torch.full((8,), 512, dtype=torch.int32), k_cache, v_cache
        )
        few = cpu_decode.plan_decode(
            tables, torch.full((8,), 3, dtype=torch.int32), k_cache, v_cache
        )
    finally:
        torch.set_num_threads(threads)
    assert isinstance(many, KernelDecode) and isinstance(few, KernelDecode)
    assert (many.threads, few.threads) == (3, 1)


def test_the_kernel_compiles_where_there_is_a_compiler():
    if cpu_native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_native.load() is not None


# A process loads the library and prints what its decode attention gives, bit for bit.
_LOAD_AND_DECODE = """
import hashlib, logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from batchgen.kernels.cpu import native
from batchgen.kernels.cpu.decode_native import plan_kernel_decode
gen = torch.Generator().manual_seed(7)
k_cache, v_cache = (torch.randn(24, 16, 2, 32, generator=gen) for _ in range(2))
tables = torch.randperm(24, generator=gen)[:20].view(4, 5).to(torch.int32)
lens = torch.tensor([80, 33, 1, 57], dtype=torch.int32)
q = torch.randn(4, 8, 32, generator=gen)
plan = plan_kernel_decode(tables, lens, k_cache, v_cache)
print(hashlib.sha256(plan(q, k_cache, v_cache, 0.17).numpy().tobytes()).hexdigest())
"""


def _counting_compiler(tmp_path):
    """$CC for a child: the machine's compiler, each run of it a line in a file."""
    real = cpu_native._compiler()
    if real is None:
        pytest.skip("no C compiler on this machine")
    count = tmp_path / "compiler-runs"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\necho run >> "{count}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, count


def _runs(count):
    return len(count.read_text().splitlines()) if count.exists() else 0


def _load_in_a_process(tmp_path, wrapper):
    env = {**os.environ, "CC": str(wrapper), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    return subprocess.Popen([sys.executable, "-c", _LOAD_AND_DECODE], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _decoded(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out.strip(), err


def test_the_library_is_compiled_once_and_loaded_from_the_cache_after(tmp_path):
    wrapper, count = _counting_compiler(tmp_path)
    first, _ = _decoded(_load_in_a_process(tmp_path, wrapper))
    compiled = _runs(count)
    assert compiled >= 1  # one run per set of flags tried, until one builds
    (entry,) = (tmp_path / "cache" / "batchgen" / "kernels").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == [cpu_native.LIBRARY, cpu_native.DIGEST]
    second, err = _decoded(_load_in_a_process(tmp_path, wrapper))
    assert _runs(count) == compiled, "the second process ran the compiler"
    assert "compiling" not in err
    assert second == first


def test_processes_building_at_once_all_get_the_whole_library(tmp_path):
    wrapper, _ = _counting_compiler(tmp_path)
    procs = [_load_in_a_process(tmp_path, wrapper) for _ in range(3)]
    results = {_decoded(proc)[0] for proc in procs}
    assert len(results) == 1
    # one entry, whole; every build's temporary folder is gone
    (entry,) = (tmp_path / "cache" / "batchgen" / "kernels").iterdir()
    assert cpu_native._intact(entry)


def test_a_truncated_cached_library_is_built_again_not_loaded(tmp_path):
    wrapper, count = _counting_compiler(tmp_path)
    first, _ = _decoded(_load_in_a_process(tmp_path, wrapper))
    (entry,) = (tmp_path / "cache" / "batchgen" / "kernels").iterdir()
    library = entry / cpu_native.LIBRARY
    whole = library.read_bytes()
    library.write_bytes(whole[: len(whole) // 2])  # as a crash or a full disk leaves it
    compiled = _runs(count)
    again, err = _decoded(_load_in_a_process(tmp_path, wrapper))
    assert "is damaged: replacing it" in err
    assert _runs(count) > compiled
    assert again == first  # exact: the same bits as before
    assert cpu_native._intact(entry) and library.read_bytes() == whole


def test_an_unwritable_cache_compiles_for_the_process_only(tmp_path):
    wrapper, _ = _counting_compiler(tmp_path)
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    expected, _ = _decoded(_load_in_a_process(tmp_path / "elsewhere", wrapper))
    got, err = _decoded(_load_in_a_process(tmp_path, wrapper))
    assert "cannot be used" in err and "compiling for this process only" in err
    assert got == expected


def test_the_kernel_refuses_block_ids_and_lengths_it_cannot_read():
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    k_cache, v_cache, tables, _ = _paged([40, 17], 2, 16, 16)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    outside = tables.clone()
    outside[1, 0] = k_cache.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="block ids must be in"):
        cpu_decode.plan_decode(outside, lens, k_cache, v_cache)
    with pytest.raises(ValueError, match="context lengths must be in"):
        cpu_decode.plan_decode(tables, torch.tensor([40, 200], dtype=torch.int32), k_cache, v_cache)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 3)])
def test_prefill_matches_dense_with_cached_prefix(num_heads, num_kv_heads):
    contexts = [5, 16, 40, 33]
    q_lens = [5, 3, 17, 1]  # full prompt, chunk after a prefix hit, long chunk, decode
    head_dim, block_size = 16, 16
    k_cache, v_cache, tables, rows_kv = _paged(contexts, num_kv_heads, head_dim, block_size)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim)
    out = cpu_attention.paged_prefill_attention(
        q, k_cache, v_cache, tables,
        torch.tensor(contexts, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
        0.25, max(q_lens), max(contexts),
    )  # fmt: skip
    for i, (k, v) in enumerate(rows_kv):
        expected = dense.attend(q[starts[i] : starts[i + 1]], k, v, 0.25)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_store_kv_writes_slots_and_skips_padding():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key = torch.randn(3, 2, 8)
    value = torch.randn(3, 2, 8)
    slots = torch.tensor([9, ref.PAD_SLOT_ID, 2])
    ref.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[2, 1], value[0])
    assert torch.equal(k_cache[0, 2], key[2]) and torch.equal(v_cache[0, 2], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2  # nothing else written


def test_rotary_matches_hf_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim, base = 16, 10000.0
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    positions = torch.tensor([0, 1, 7, 100])
    freqs = torch.arange(128).float()[:, None] * inv_freq[None, :]
    q = torch.randn(4, 3, head_dim)
    k = torch.randn(4, 1, head_dim)
    q2, k2 = ref.apply_rotary(q, k, positions, freqs.cos(), freqs.sin())
    emb = torch.cat((freqs[positions], freqs[positions]), dim=-1)
    # HF layout: (batch, heads, seq, dim)
    hq, hk = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    torch.testing.assert_close(q2, hq[0].transpose(0, 1))
    torch.testing.assert_close(k2, hk[0].transpose(0, 1))


def test_norms_and_activation():
    x = torch.randn(5, 12)
    res = torch.randn(5, 12)
    w = torch.rand(12) + 0.5
    expected = w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6), expected)
    normed, new_res = ref.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, ref.rms_norm(x + res, w, 1e-6))
    y = torch.randn(5, 8)
    torch.testing.assert_close(ref.silu_and_mul(y), torch.nn.functional.silu(y[:, :4]) * y[:, 4:])


def test_decode_in_length_groups_matches_dense():
    contexts = sorted([3, 200, 17, 150, 40, 90, 5, 260, 64, 33, 120, 8], reverse=True)
    assert len(cpu_decode._length_groups(contexts)) > 1  # the grouped path is the one under test
    head_dim, block_size = 16, 16
    k_cache, v_cache, tables, rows_kv = _paged(contexts, 2, head_dim, block_size, seed=3)
    q = torch.randn(len(contexts), 4, head_dim)
    out = _decode("torch", q, k_cache, v_cache, tables, contexts, 0.25)
    _assert_decode_rows_match_dense(out, q, rows_kv, 0.25)


def test_length_groups_are_contiguous_ranges_of_sorted_rows():
    lengths = [800, 700, 650, 400, 390, 30, 25, 20, 10, 5]
    groups = cpu_decode._length_groups(lengths)
    assert groups == [(0, 4), (4, 5), (5, 10)]
    assert cpu_decode._length_groups([5, 800, 10]) == [(0, 3)]  # unsorted: one padded group
    assert cpu_decode._length_groups([100] * 8) == [(0, 8)]


@pytest.mark.parametrize("path", PATHS)
def test_decode_padding_row_with_no_context_yields_zeros(path):
    # CUDA-graph batches are padded with rows of context 0; their softmax over
    # nothing used to be NaN. The Triton kernel writes zeros; so does the CPU path.
    k_cache, v_cache, tables, rows_kv = _paged([17, 3], 2, 16, 16)
    q = torch.randn(2, 4, 16)
    out = _decode(path, q, k_cache, v_cache, tables, [17, 0], 0.25)
    assert torch.equal(out[1], torch.zeros(4, 16))
    k, v = rows_kv[0]
    torch.testing.assert_close(out[:1], dense.attend(q[:1], k, v, 0.25))


@pytest.mark.parametrize("path", PATHS)
def test_decode_of_rows_sharing_prefix_blocks_matches_dense(path):
    # rows 0, 2 and 4 share their first 2 blocks (a prefix-cache hit), the others not
    block_size, head_dim = 16, 16
    gen = torch.Generator().manual_seed(6)
    k_cache = torch.randn(40, block_size, 2, head_dim, generator=gen)
    v_cache = torch.randn(40, block_size, 2, head_dim, generator=gen)
    tables = torch.tensor(
        [[7, 30, 11], [9, 10, 20], [7, 30, 13], [21, 22, 23], [7, 30, 15]], dtype=torch.int32
    )
    contexts = [45, 44, 40, 39, 33]
    q = torch.randn(5, 4, head_dim, generator=gen)
    out = _decode(path, q, k_cache, v_cache, tables, contexts, 0.3)
    rows_kv = _dense_of(k_cache, v_cache, tables, contexts)
    _assert_decode_rows_match_dense(out, q, rows_kv, 0.3)


def _reference_forbidden(monkeypatch, *names):
    """The C path must not fall back to reference.py for these ops."""
    for name in names:
        monkeypatch.setattr(
            cpu_elementwise.reference, name, lambda *a, **k: pytest.fail("fell back to torch")
        )


def test_norms_in_c_equal_the_reference(monkeypatch):
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    gen = torch.Generator().manual_seed(11)
    fused = torch.randn(5, 3 * 96, generator=gen)
    x = fused[:, :96]  # rows at a stride, as a view of a wider tensor
    residual, weight = torch.randn(5, 96, generator=gen), torch.rand(96, generator=gen) + 0.5
    expected = ref.rms_norm(x, weight, 1e-6), ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    _reference_forbidden(monkeypatch, "rms_norm", "fused_add_rms_norm")
    torch.testing.assert_close(cpu_elementwise.rms_norm(x, weight, 1e-6), expected[0])
    normed, summed = cpu_elementwise.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, expected[1][1])  # one rounding, like torch's add
    torch.testing.assert_close(normed, expected[1][0])


def test_rotary_in_c_equals_the_reference(monkeypatch):
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    gen = torch.Generator().manual_seed(12)
    heads, kv_heads, head_dim, tokens = 6, 2, 16, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(64).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.tensor([0, 1, 7, 63, 30])
    expected = ref.apply_rotary(q, k, positions, cos, sin)
    _reference_forbidden(monkeypatch, "apply_rotary")
    got = cpu_elementwise.apply_rotary(q, k, positions, cos, sin)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    with pytest.raises(IndexError, match="outside the table's 64 rows"):
        cpu_elementwise.apply_rotary(q, k, torch.tensor([0, 1, 2, 64, 3]), cos, sin)


def test_other_dtypes_and_layouts_take_the_reference():
    x = torch.randn(2, 3, 8)  # three dimensions: no single row stride
    w = torch.rand(8) + 0.5
    torch.testing.assert_close(cpu_elementwise.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    half = cpu_elementwise.rms_norm(x[0].bfloat16(), w.bfloat16(), 1e-6)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half, ref.rms_norm(x[0].bfloat16(), w.bfloat16(), 1e-6))


def test_silu_and_mul_in_c_equals_the_reference(monkeypatch):
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    gen = torch.Generator().manual_seed(13)
    wide = torch.randn(6, 3 * 2 * 37, generator=gen) * 6  # rows at a stride; 37: a tail past 8s
    x = wide[:, : 2 * 37]
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^-g at the floats' ends
    expected = ref.silu_and_mul(x)
    _reference_forbidden(monkeypatch, "silu_and_mul")
    got = cpu_elementwise.silu_and_mul(x)
    assert got.shape == (6, 37) and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


def test_store_kv_in_c_writes_what_the_reference_writes(monkeypatch):
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")
    gen = torch.Generator().manual_seed(14)
    qkv = torch.randn(4, 3, 2, 8, generator=gen)  # q, k, v of 4 tokens, as a view of one tensor
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([9, ref.PAD_SLOT_ID, 2, 11])
    caches = [torch.zeros(3, 4, 2, 8) for _ in range(4)]
    ref.store_kv(key, value, caches[0], caches[1], slots)
    _reference_forbidden(monkeypatch, "store_kv")
    cpu_elementwise.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    for bad in (12, -2):
        with pytest.raises(IndexError, match="outside the cache's 12 slots"):
            cpu_elementwise.store_kv(key, value, caches[2], caches[3], torch.tensor([0, 1, bad, 3]))
    assert torch.equal(caches[2], caches[0])  # a refused step writes nothing


def test_a_new_build_keeps_the_entries_used_last_and_removes_the_rest(tmp_path):
    wrapper, _ = _counting_compiler(tmp_path)
    root = tmp_path / "cache" / "batchgen" / "kernels"
    root.mkdir(parents=True)
    old = [root / f"{i:032x}" for i in range(12)]  # entries of earlier sources or compilers
    for i, entry in enumerate(old):
        entry.mkdir()
        (entry / cpu_native.LIBRARY).write_bytes(b"x")
        os.utime(entry, (1_000_000 + i, 1_000_000 + i))  # entry 11 used last
    (root / ".building.abc").mkdir()  # another process's build in progress: not an entry
    _decoded(_load_in_a_process(tmp_path, wrapper))
    kept = sorted(p.name for p in root.iterdir())
    (new,) = set(kept) - {p.name for p in old} - {".building.abc"}
    assert kept == sorted(
        [new, ".building.abc", *(p.name for p in old[12 - cpu_native.KEEP + 1 :])]
    )
    # a load of an entry marks it used: it outlives entries used after it was built
    os.utime(root / new, (1, 1))
    _decoded(_load_in_a_process(tmp_path, wrapper))
    assert (root / new).stat().st_mtime > 1_000_011
