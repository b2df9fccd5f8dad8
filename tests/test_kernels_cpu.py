"""The CPU path against the plain versions: attention against ``dense.py`` (itself
checked against a loop over heads and positions), the other ops against naive math."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.kernels import cpu_attention, cpu_decode, dense
from batchgen.kernels import reference as ref


def _attention_by_loops(q, k, v, scale):
    """q (q_len, H, D) at the last q_len positions of k/v (ctx, Hk, D), causal."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for t in range(q_len):
        pos = ctx - q_len + t
        for h in range(num_heads):
            kh = k[: pos + 1, h // group]
            w = torch.softmax((kh @ q[t, h]) * scale, dim=0)
            out[t, h] = w @ v[: pos + 1, h // group]
    return out


@pytest.mark.parametrize("q_len,ctx", [(1, 1), (1, 40), (5, 5), (7, 30)])
def test_the_oracle_is_attention_by_loops(q_len, ctx):
    gen = torch.Generator().manual_seed(q_len * 100 + ctx)
    q = torch.randn(q_len, 6, 16, generator=gen)
    k, v = torch.randn(ctx, 2, 16, generator=gen), torch.randn(ctx, 2, 16, generator=gen)
    torch.testing.assert_close(dense.attend(q, k, v, 0.3), _attention_by_loops(q, k, v, 0.3))


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


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_dense(num_heads, num_kv_heads, block_size):
    contexts = [1, 15, 16, 17, 33, 70]
    head_dim = 32
    k_cache, v_cache, tables, rows_kv = _paged(contexts, num_kv_heads, head_dim, block_size)
    q = torch.randn(len(contexts), num_heads, head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_decode.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), scale, max(contexts)
    )
    _assert_decode_rows_match_dense(out, q, rows_kv, scale)


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
    out = cpu_decode.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), 0.25, max(contexts)
    )
    _assert_decode_rows_match_dense(out, q, rows_kv, 0.25)


def test_length_groups_are_contiguous_ranges_of_sorted_rows():
    lengths = [800, 700, 650, 400, 390, 30, 25, 20, 10, 5]
    groups = cpu_decode._length_groups(lengths)
    assert groups == [(0, 4), (4, 5), (5, 10)]
    assert cpu_decode._length_groups([5, 800, 10]) == [(0, 3)]  # unsorted: one padded group
    assert cpu_decode._length_groups([100] * 8) == [(0, 8)]


def test_decode_padding_row_with_no_context_yields_zeros():
    # CUDA-graph batches are padded with rows of context 0; their softmax over
    # nothing used to be NaN. The Triton kernel writes zeros; so does the CPU path.
    k_cache, v_cache, tables, rows_kv = _paged([17, 3], 2, 16, 16)
    q = torch.randn(2, 4, 16)
    out = cpu_decode.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor([17, 0], dtype=torch.int32), 0.25, 17
    )
    assert torch.equal(out[1], torch.zeros(4, 16))
    k, v = rows_kv[0]
    torch.testing.assert_close(out[:1], dense.attend(q[:1], k, v, 0.25))


def test_decode_with_a_prefix_shared_by_every_row_matches_dense():
    # rows 0..3 share their first 3 blocks (a common 48-token prompt prefix)
    block_size, head_dim, num_kv_heads = 16, 16, 2
    contexts = [70, 64, 49, 55]
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(40, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(40, block_size, num_kv_heads, head_dim, generator=gen)
    shared = [7, 30, 2]
    own = [[11, 12], [13], [14], [15, 16]]
    tables = torch.tensor([shared + o + [o[-1]] * (2 - len(o)) for o in own], dtype=torch.int32)
    assert cpu_decode._shared_prefix_blocks(tables, (min(contexts) - 1) // block_size) == 3
    q = torch.randn(4, 4, head_dim, generator=gen)
    out = cpu_decode.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), 0.3, max(contexts)
    )
    rows_kv = _dense_of(k_cache, v_cache, tables, contexts)
    _assert_decode_rows_match_dense(out, q, rows_kv, 0.3)


def test_shared_prefix_needs_every_row_and_a_token_of_suffix():
    tables = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 5, 6]], dtype=torch.int32)
    assert cpu_decode._shared_prefix_blocks(tables, 2) == 1
    assert cpu_decode._shared_prefix_blocks(tables, 0) == 0
    assert cpu_decode._shared_prefix_blocks(tables[:1], 2) == 0  # one row: nothing to share


def test_decode_with_a_prefix_shared_by_some_rows_matches_dense():
    block_size, head_dim = 16, 16
    gen = torch.Generator().manual_seed(6)
    k_cache = torch.randn(40, block_size, 2, head_dim, generator=gen)
    v_cache = torch.randn(40, block_size, 2, head_dim, generator=gen)
    tables = torch.tensor(
        [[7, 30, 11], [9, 10, 20], [7, 30, 13], [21, 22, 23], [7, 30, 15]], dtype=torch.int32
    )
    contexts = [45, 44, 40, 39, 33]
    assert cpu_decode._rows_sharing_a_prefix(tables, contexts, block_size) == ([0, 2, 4], 2)
    q = torch.randn(5, 4, head_dim, generator=gen)
    out = cpu_decode.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32), 0.3, 45
    )
    rows_kv = _dense_of(k_cache, v_cache, tables, contexts)
    _assert_decode_rows_match_dense(out, q, rows_kv, 0.3)
