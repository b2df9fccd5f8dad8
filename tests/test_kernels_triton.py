"""The Triton ops against the plain versions: attention against ``dense.py``,
the other ops against ``reference.py``.

Without CUDA they run on the CPU through the Triton interpreter (conftest sets
TRITON_INTERPRET=1 before anything imports the kernels); with CUDA the same
tests run compiled. Shapes are small because the interpreter is slow.

What the interpreter does differently (Triton 3.9), and how the tests cope:
- tl.dot on bf16 multiplies raw uint16 bits, so the wrappers upcast bf16 dot
  operands to fp32 under the interpreter (``checks.dot_in_fp32``); the bf16
  tensor-core path itself is only exercised on a GPU (``gpu`` tests,
  benchmarks/gpu_check.py).
- fp32 -> bf16 casts truncate instead of rounding to nearest even, so bf16
  results may sit one bf16 ulp off the reference: bf16 tolerances allow it.
"""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch

from batchgen.kernels import dense
from batchgen.kernels import reference as ref
from batchgen.kernels.ops import CPU_OPS, QuantGemms, select_ops
from batchgen.kernels.reference import PAD_SLOT_ID

pytest.importorskip("triton")

from batchgen.kernels.triton.decode_attention import decode_attention
from batchgen.kernels.triton.op_set import TRITON_OPS
from batchgen.kernels.triton.prefill_attention import prefill_attention
from batchgen.kernels.triton.split_k import choose_num_splits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# (atol, rtol) by dtype; attention outputs are O(1)
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
# K/V written where no sequence's context lies: any read of a wrong block or
# a position past context_len shows up as a large error.
POISON = 4.0


def _paged(contexts, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """Random K/V for each context, in shuffled blocks of a pool with spare blocks.

    Returns (k_cache, v_cache, block_tables int32); every slot that belongs to
    no context holds POISON. Table rows are one block wider than needed and
    their tails repeat the sequence's last block, as the contract allows.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in contexts]
    total = sum(need) + 3
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    owned = torch.zeros(total, block_size, dtype=torch.bool)
    perm = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(len(contexts), max(need, default=0) + 1, dtype=torch.int32)
    for i, (ctx, nb) in enumerate(zip(contexts, need)):
        ids = [perm.pop() for _ in range(nb)]
        for j, block in enumerate(ids):
            owned[block, : min(block_size, ctx - j * block_size)] = True
        if ids:
            tables[i, :nb] = torch.tensor(ids)
            tables[i, nb:] = ids[-1]
    k_cache[~owned] = POISON
    v_cache[~owned] = POISON
    return k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def _index(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _randn(*shape, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


# --------------------------------------------------------------------------- selection


def test_select_ops_picks_triton_on_cuda_and_when_forced():
    assert select_ops(torch.device("cpu")) is CPU_OPS
    assert select_ops(torch.device("cpu"), use_triton=True) is TRITON_OPS
    assert select_ops(torch.device("cuda")) is TRITON_OPS
    assert select_ops(torch.device("cuda"), use_triton=False) is CPU_OPS
    assert TRITON_OPS.name == "triton"


@pytest.mark.parametrize("op", [f for f in CPU_OPS.__slots__ if f not in ("name", "quant_gemms")])
def test_triton_ops_have_the_cpu_signatures(op):
    assert inspect.signature(getattr(TRITON_OPS, op)) == inspect.signature(getattr(CPU_OPS, op))


def test_only_the_triton_ops_carry_gemms_for_quantized_weights():
    # the CPU path multiplies quantized projections itself (tile by tile, or torch._int_mm)
    assert CPU_OPS.quant_gemms is None and isinstance(TRITON_OPS.quant_gemms, QuantGemms)


# --------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [(3, 80), (12, 128)])  # 12 x 128: two head blocks
def test_store_kv_writes_exact_slots_and_skips_padding(dtype, heads, head_dim):
    num_blocks, block_size = 4, 16
    k_cache = _randn(num_blocks, block_size, heads, head_dim, dtype=dtype, seed=2)
    v_cache = _randn(num_blocks, block_size, heads, head_dim, dtype=dtype, seed=3)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    # key/value as strided views of a fused (tokens, 2 * heads * head_dim) buffer
    kv = _randn(5, 2 * heads * head_dim, dtype=dtype, seed=4)
    key = kv[:, : heads * head_dim].view(5, heads, head_dim)
    value = kv[:, heads * head_dim :].view(5, heads, head_dim)
    slots = [17, PAD_SLOT_ID, 0, 63, PAD_SLOT_ID]  # block 1 slot 1, block 0 slot 0, last slot
    TRITON_OPS.store_kv(key, value, k_cache, v_cache, _index(slots, torch.int64))

    expected_k, expected_v = before_k.clone(), before_v.clone()
    for token, slot in enumerate(slots):
        if slot != PAD_SLOT_ID:
            expected_k[slot // block_size, slot % block_size] = key[token]
            expected_v[slot // block_size, slot % block_size] = value[token]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    changed = (k_cache != before_k).any(-1).any(-1).nonzero().tolist()
    assert changed == [[0, 0], [1, 1], [3, 15]]


def test_store_kv_empty_and_all_padding_write_nothing():
    k_cache = _randn(2, 16, 2, 64, seed=5)
    v_cache = _randn(2, 16, 2, 64, seed=6)
    before = k_cache.clone(), v_cache.clone()
    empty = _randn(0, 2, 64)
    TRITON_OPS.store_kv(empty, empty, k_cache, v_cache, _index([], torch.int64))
    pad = _randn(3, 2, 64)
    TRITON_OPS.store_kv(pad, pad, k_cache, v_cache, _index([PAD_SLOT_ID] * 3, torch.int64))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_store_kv_rejects_bad_input():
    k_cache = _randn(2, 16, 2, 64)
    key = _randn(3, 2, 64)
    slots = _index([0, 1, 2], torch.int64)
    with pytest.raises(TypeError, match="slot_mapping"):
        TRITON_OPS.store_kv(key, key, k_cache, k_cache.clone(), slots.int())
    with pytest.raises(TypeError, match="dtypes must match"):
        TRITON_OPS.store_kv(key.half(), key.half(), k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match="k_cache heads/head_dim"):
        TRITON_OPS.store_kv(key, key, _randn(2, 16, 4, 64), _randn(2, 16, 4, 64), slots)


# --------------------------------------------------------------------------- decode


def _decode_case(contexts, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    k_cache, v_cache, tables = _paged(contexts, num_kv_heads, head_dim, block_size, dtype, seed)
    q = _randn(len(contexts), num_heads, head_dim, dtype=dtype, seed=seed + 7)
    return q, k_cache, v_cache, tables, _index(contexts)


CONTEXTS = [1, 15, 16, 17, 33, 70]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_dense_gqa_and_block_sizes(num_heads, num_kv_heads, block_size):
    q, k_cache, v_cache, tables, ctx = _decode_case(
        CONTEXTS, num_heads, num_kv_heads, 64, block_size, torch.float32
    )
    scale = 1 / math.sqrt(64)
    expected = dense.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, 70)
    out = TRITON_OPS.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, 70)
    _close(out, expected, torch.float32)
    # tiles of 16 tokens: contexts cross several tiles and pages within a program
    out = decode_attention(q, k_cache, v_cache, tables, ctx, scale, 70, tile_size=16)
    _close(out, expected, torch.float32)


@pytest.mark.parametrize("head_dim", [48, 80])
def test_decode_pads_head_dims_that_are_not_powers_of_two(head_dim):
    q, k_cache, v_cache, tables, ctx = _decode_case(CONTEXTS, 6, 3, head_dim, 16, torch.float32)
    expected = dense.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 70)
    out = decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 70, num_splits=2)
    _close(out, expected, torch.float32)


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_decode_split_k_merges_partials_including_empty_splits(num_splits):
    # 8 splits over a 1-token context leave 7 empty; 130 tokens in 9 tiles of 16
    # split unevenly; 0 is a padding row.
    contexts = [1, 17, 70, 130, 0]
    q, k_cache, v_cache, tables, ctx = _decode_case(contexts, 8, 2, 64, 16, torch.float32)
    expected = dense.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, 130)
    out = decode_attention(
        q, k_cache, v_cache, tables, ctx, 0.125, 130, num_splits=num_splits, tile_size=16
    )
    _close(out, expected, torch.float32)
    assert torch.equal(out[4], torch.zeros_like(out[4]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_half_precision(dtype, num_splits):
    q, k_cache, v_cache, tables, ctx = _decode_case(CONTEXTS, 8, 2, 80, 16, dtype)
    expected = dense.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 70)
    out = decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 70, num_splits=num_splits)
    assert out.dtype == dtype
    _close(out, expected, dtype)


def test_decode_reads_a_strided_q_and_handles_single_and_empty_batches():
    q, k_cache, v_cache, tables, ctx = _decode_case([17], 4, 2, 64, 16, torch.float32)
    # q as a view of a fused qkv row: stride(0) > num_heads * head_dim
    qkv = _randn(1, 8 * 64)
    q = qkv[:, : 4 * 64].view(1, 4, 64)
    expected = dense.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, 17)
    out = TRITON_OPS.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, 17)
    _close(out, expected, torch.float32)

    empty = TRITON_OPS.paged_decode_attention(
        q[:0], k_cache, v_cache, tables[:0], ctx[:0], 0.125, 0
    )
    assert empty.shape == (0, 4, 64)


def test_attention_accepts_int64_index_tensors():
    q, k_cache, v_cache, tables, ctx = _decode_case(CONTEXTS, 8, 2, 64, 16, torch.float32)
    args = (q, k_cache, v_cache, tables.long(), ctx.long(), 0.125, 70)
    _close(
        decode_attention(*args, num_splits=2), dense.paged_decode_attention(*args), torch.float32
    )
    q, k_cache, v_cache, tables, ctx, starts = _prefill_case(8, 2, 64, 16, torch.float32)
    chunks = (q, k_cache, v_cache, tables.long(), ctx.long(), starts.long(), 0.125, 17, 40)
    expected = dense.paged_prefill_attention(*chunks)
    _close(TRITON_OPS.paged_prefill_attention(*chunks), expected, torch.float32)


def test_decode_rejects_bad_input():
    q, k_cache, v_cache, tables, ctx = _decode_case([17], 4, 2, 64, 16, torch.float32)
    with pytest.raises(TypeError, match="dtypes must match"):
        decode_attention(q.half(), k_cache, v_cache, tables, ctx, 0.1, 17)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention(q[:, :3], k_cache, v_cache, tables, ctx, 0.1, 17)
    with pytest.raises(ValueError, match="block table's capacity"):
        decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 1000)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 17, num_splits=3)


def test_choose_num_splits_fills_the_gpu_without_tiny_splits():
    # (num_seqs, num_kv_heads, max_context_len, SMs) -> splits
    assert choose_num_splits(128, 8, 2048, 132) == 1  # 1024 programs already
    assert choose_num_splits(64, 8, 8192, 132) == 1  # 512 programs: ~4 per SM
    assert choose_num_splits(1, 8, 8192, 132) == 32  # 66 wanted, 32 x 256 tokens useful
    assert choose_num_splits(8, 8, 8192, 132) == 8  # 8 wanted
    assert choose_num_splits(4, 8, 512, 132) == 2  # splits of fewer than 256 tokens do not pay
    assert choose_num_splits(2, 1, 100_000, 132) == 64  # capped
    assert choose_num_splits(1, 1, 1, 132) == 1
    assert choose_num_splits(0, 8, 0, 132) == 1


# --------------------------------------------------------------------------- prefill

# full prompt, chunk after a prefix-cache hit, long chunk over cached pages,
# a decode row, a one-token prompt, a sequence with no new tokens this step
PREFILL_CONTEXTS = [5, 16, 40, 33, 1, 20]
PREFILL_Q_LENS = [5, 3, 17, 1, 1, 0]


def _prefill_case(num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    k_cache, v_cache, tables = _paged(
        PREFILL_CONTEXTS, num_kv_heads, head_dim, block_size, dtype, seed
    )
    starts = [0]
    for n in PREFILL_Q_LENS:
        starts.append(starts[-1] + n)
    q = _randn(starts[-1], num_heads, head_dim, dtype=dtype, seed=seed + 9)
    return q, k_cache, v_cache, tables, _index(PREFILL_CONTEXTS), _index(starts)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 3), (8, 1), (6, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_dense_gqa_and_block_sizes(num_heads, num_kv_heads, block_size):
    q, k_cache, v_cache, tables, ctx, starts = _prefill_case(
        num_heads, num_kv_heads, 64, block_size, torch.float32
    )
    args = (q, k_cache, v_cache, tables, ctx, starts, 0.125, 17, 40)
    expected = dense.paged_prefill_attention(*args)
    _close(TRITON_OPS.paged_prefill_attention(*args), expected, torch.float32)


@pytest.mark.parametrize("block_m,tile_size", [(16, 16), (32, 16), (64, 32)])
def test_prefill_query_blocks_and_key_tiles(block_m, tile_size):
    # group 2 with block_m 16: 8 tokens per program, so the 17-token chunk spans
    # three query blocks whose causal limits differ; head_dim 80 is padded.
    q, k_cache, v_cache, tables, ctx, starts = _prefill_case(6, 3, 80, 16, torch.float32)
    args = (q, k_cache, v_cache, tables, ctx, starts, 0.1, 17, 40)
    expected = dense.paged_prefill_attention(*args)
    out = prefill_attention(*args, block_m=block_m, tile_size=tile_size)
    _close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(dtype):
    q, k_cache, v_cache, tables, ctx, starts = _prefill_case(8, 2, 48, 16, dtype)
    args = (q, k_cache, v_cache, tables, ctx, starts, 0.15, 17, 40)
    out = TRITON_OPS.paged_prefill_attention(*args)
    assert out.dtype == dtype
    _close(out, dense.paged_prefill_attention(*args), dtype)


def test_prefill_empty_batch_and_bad_input():
    q, k_cache, v_cache, tables, ctx, starts = _prefill_case(4, 2, 64, 16, torch.float32)
    out = TRITON_OPS.paged_prefill_attention(
        q[:0], k_cache, v_cache, tables[:0], ctx[:0], starts[:1], 0.1, 0, 0
    )
    assert out.shape == (0, 4, 64)
    with pytest.raises(ValueError, match="query_start_loc"):
        TRITON_OPS.paged_prefill_attention(
            q, k_cache, v_cache, tables, ctx, starts[:-1], 0.1, 17, 40
        )
    with pytest.raises(TypeError, match="query_start_loc"):
        TRITON_OPS.paged_prefill_attention(
            q, k_cache, v_cache, tables, ctx, starts.float(), 0.1, 17, 40
        )


def test_ops_compose_into_prefill_then_decode():
    """A layer's attention path, step by step, with each op table on its own cache."""
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 64, 16
    freqs = torch.arange(64).float()[:, None] / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    tables = _index([[2, 0, 3], [1, 4, 4]])
    # step 1: prompts of 20 and 5 tokens; step 2: one decode token each
    steps = [([20, 5], [0, 20, 25]), ([21, 6], [0, 1, 2])]
    results = {}
    for ops in (CPU_OPS, TRITON_OPS):
        k_cache = torch.zeros(5, block_size, num_kv_heads, head_dim, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        outs = []
        for step, (contexts, starts) in enumerate(steps):
            q_lens = [b - a for a, b in itertools.pairwise(starts)]
            positions = [p for c, n in zip(contexts, q_lens) for p in range(c - n, c)]
            slots = [
                int(tables[i, p // block_size]) * block_size + p % block_size
                for i, (c, n) in enumerate(zip(contexts, q_lens))
                for p in range(c - n, c)
            ]
            n = starts[-1]
            qkv = _randn(n, (num_heads + 2 * num_kv_heads) * head_dim, seed=20 + step)
            q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
            k = qkv[:, num_heads * head_dim : -num_kv_heads * head_dim].view(n, 2, head_dim)
            v = qkv[:, -num_kv_heads * head_dim :].view(n, num_kv_heads, head_dim)
            q, k = ops.apply_rotary(q, k, _index(positions, torch.int64), cos, sin)
            ops.store_kv(k, v, k_cache, v_cache, _index(slots, torch.int64))
            ctx = _index(contexts)
            if step == 0:
                out = ops.paged_prefill_attention(
                    q, k_cache, v_cache, tables, ctx, _index(starts), 0.125, 20, 21
                )
            else:
                out = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, 21)
            outs.append(out)
        results[ops.name] = (outs, k_cache, v_cache)
    for got, expected in zip(results["triton"][0], results["cpu"][0]):
        _close(got, expected, torch.float32)
    # rotary may round differently (the CPU path fuses multiply-adds): close, not equal;
    # store_kv's exact slots are checked on their own above
    _close(results["triton"][1], results["cpu"][1], torch.float32)
    assert torch.equal(results["triton"][2], results["cpu"][2])  # v is not rotated


# --------------------------------------------------------------------------- norms, rotary, act


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 80)])
def test_rms_norm_and_fused_add(dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=30)
    residual = _randn(*shape, dtype=dtype, seed=31)
    weight = (_randn(shape[-1], seed=32).abs() + 0.5).to(dtype)
    _close(TRITON_OPS.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), dtype)
    normed, summed = TRITON_OPS.fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_normed, expected_summed = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert summed.dtype == expected_summed.dtype and normed.dtype == expected_normed.dtype
    if dtype == torch.bfloat16:  # the interpreter's bf16 cast truncates
        _close(summed, expected_summed, dtype)
    else:
        assert torch.equal(summed, expected_summed)  # one rounding, like torch's add
    _close(normed, expected_normed, dtype)


def test_rms_norm_promotes_like_the_reference_and_handles_empty_rows():
    x = _randn(4, 64, dtype=torch.bfloat16)
    weight = _randn(64).abs() + 0.5  # fp32 weight with bf16 activations -> fp32 out
    out = TRITON_OPS.rms_norm(x, weight, 1e-6)
    expected = ref.rms_norm(x, weight, 1e-6)
    assert out.dtype == expected.dtype == torch.float32
    _close(out, expected, torch.bfloat16)
    assert TRITON_OPS.rms_norm(x[:0], weight, 1e-6).shape == (0, 64)
    normed, summed = TRITON_OPS.fused_add_rms_norm(x[:0], x[:0], weight, 1e-6)
    assert normed.shape == summed.shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        TRITON_OPS.rms_norm(x, weight[:32], 1e-6)


def _rope_cache(head_dim, max_positions=128):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 3, 80), (20, 4, 16)])
def test_apply_rotary(dtype, num_heads, num_kv_heads, head_dim):
    # (20, 4): more heads than one program's BLOCK_H of 16
    tokens = 5
    qkv = _randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=40)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(tokens, num_kv_heads, head_dim)
    positions = _index([0, 1, 7, 127, 64], torch.int64)
    cos, sin = _rope_cache(head_dim)
    q_out, k_out = TRITON_OPS.apply_rotary(q, k, positions, cos, sin)
    q_ref, k_ref = ref.apply_rotary(q, k, positions, cos, sin)
    assert q_out.dtype == k_out.dtype == dtype
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)


def test_apply_rotary_empty_and_bad_input():
    cos, sin = _rope_cache(16)
    q, k = _randn(0, 4, 16), _randn(0, 2, 16)
    q_out, k_out = TRITON_OPS.apply_rotary(q, k, _index([], torch.int64), cos, sin)
    assert q_out.shape == (0, 4, 16) and k_out.shape == (0, 2, 16)
    with pytest.raises(TypeError, match="cos_cache"):
        TRITON_OPS.apply_rotary(
            _randn(1, 4, 16), _randn(1, 2, 16), _index([0], torch.int64), cos.half(), sin
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 140), (2, 3, 4200)])
def test_silu_and_mul(dtype, shape):
    # 4200 = 2 x 2100: three column blocks of 1024, the last partial
    x = _randn(*shape, dtype=dtype, seed=50)
    out = TRITON_OPS.silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    _close(out, ref.silu_and_mul(x), dtype)


def test_silu_and_mul_empty_and_odd():
    assert TRITON_OPS.silu_and_mul(_randn(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="even"):
        TRITON_OPS.silu_and_mul(_randn(2, 7))


# --------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_gpu_attention_compiles_at_realistic_shapes(head_dim):
    contexts = [1, 17, 511, 2048, 4097]
    q, k_cache, v_cache, tables, ctx = _decode_case(contexts, 32, 8, head_dim, 16, torch.bfloat16)
    expected = dense.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 4097)
    for num_splits in (None, 1, 8):
        out = decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 4097, num_splits=num_splits)
        _close(out, expected, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_replays_in_a_cuda_graph():
    contexts = [5, 40, 300, 1000]
    q, k_cache, v_cache, tables, ctx = _decode_case(contexts, 16, 4, 128, 16, torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 1024, num_splits=4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 1024, num_splits=4)
    # new contents in the same buffers, including a longer context and a padding row
    q.copy_(_randn(*q.shape, dtype=q.dtype, seed=99))
    ctx.copy_(_index([1000, 0, 7, 3]))
    tables.copy_(tables.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    expected = dense.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, 1000)
    _close(out, expected, torch.bfloat16)
