"""The MLA decode kernel (``latent_decode.py``) against ``dense.paged_decode_attention``.

The latent cache is one row per token read as both K and V, so the reference
is the dense decode with the same tensor as k_cache and v_cache and one KV
head. Shapes are small for the interpreter: a row of 32 + 16 (DeepSeek's
512 + 64 cut the same way, at a power of two), heads that fill one block, part
of one, or spill into a second, blocks laid out in shuffled, non-contiguous
order with poison in every slot no context owns.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import dense

pytest.importorskip("triton")

from batchgen.kernels.triton.latent_decode import latent_decode_attention, latent_split

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (3e-2, 2e-2)}
POISON = 4.0  # in every slot no context owns: a wrong block or position shows up large


def _latent_case(contexts, num_heads, head_dim, block_size, dtype, seed=0):
    """q, a latent cache with the contexts in shuffled blocks, block tables, context lens."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in contexts]
    total = sum(need) + 3
    cache = torch.randn(total, block_size, 1, head_dim, generator=gen)
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
    cache[~owned] = POISON
    q = torch.randn(len(contexts), num_heads, head_dim, generator=gen)
    lens = torch.tensor(contexts, dtype=torch.int32)
    return (q.to(DEVICE, dtype), cache.to(DEVICE, dtype), tables.to(DEVICE), lens.to(DEVICE))


def _check(contexts, num_heads, head_dim, block_size, dtype, **launch):
    q, cache, tables, lens = _latent_case(contexts, num_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = latent_decode_attention(q, cache, tables, lens, scale, max(contexts), **launch)
    expected = dense.paged_decode_attention(
        q.float(), cache.float(), cache.float(), tables, lens, scale, max(contexts)
    )
    assert out.shape == q.shape and out.dtype == dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    return out


def test_latent_split_cuts_at_a_power_of_two():
    assert latent_split(576) == (512, 64)  # DeepSeek V2/V3: latent 512 + rope 64
    assert latent_split(48) == (32, 16)
    assert latent_split(64) == (64, 0)


@pytest.mark.parametrize("num_heads", [16, 5, 20])  # one block, part of one, two
@pytest.mark.parametrize("block_size", [4, 16])
def test_latent_decode_matches_dense(num_heads, block_size):
    _check([1, 7, 33, 50], num_heads, 48, block_size, torch.float32, num_splits=1, tile_size=16)


@pytest.mark.parametrize("num_splits", [2, 8])
def test_latent_decode_merges_splits_including_empty_ones(num_splits):
    # 8 splits of a 3-tile context leave empty splits; a context of 0 is a padding row
    out = _check([40, 3, 0], 20, 48, 4, torch.float32, num_splits=num_splits, tile_size=16)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_latent_decode_power_of_two_row_has_no_rest():
    _check([9, 21], 16, 32, 8, torch.float32, num_splits=2, tile_size=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_latent_decode_half_precision(dtype):
    _check([5, 37], 20, 48, 4, dtype, num_splits=1, tile_size=16)


def test_latent_decode_rejects_bad_input():
    q, cache, tables, lens = _latent_case([5], 4, 48, 4, torch.float32)
    with pytest.raises(ValueError, match="one row per token"):
        latent_decode_attention(q, cache.expand(-1, -1, 2, -1), tables, lens, 0.1, 5)
    with pytest.raises(ValueError, match="head_dim 800"):
        big = torch.zeros(1, 4, 1, 800)
        latent_decode_attention(torch.zeros(1, 4, 800), big, tables, lens, 0.1, 4)
    with pytest.raises(ValueError, match="num_splits"):
        latent_decode_attention(q, cache, tables, lens, 0.1, 5, num_splits=3)
    with pytest.raises(TypeError, match="dtypes must match"):
        latent_decode_attention(q.half(), cache, tables, lens, 0.1, 5)


def test_a_step_on_the_latent_cache_runs_decodes_and_prefill_chunks_on_the_latent_kernel():
    """Two decodes and two prefill chunks (each chunk token a row over its causal prefix)
    through TritonAttention, against the dense decode and prefill on the same cache."""
    from batchgen.kernels.batch import AttentionBatch, AttentionKind
    from batchgen.kernels.reference import PAD_SLOT_ID
    from batchgen.kernels.triton.op_set import TRITON_OPS
    from batchgen.kernels.triton.step import TritonAttention

    contexts, q_lens = [5, 19, 12, 7], [1, 1, 4, 7]  # decodes, then chunks ending the context
    q, cache, tables, lens = _latent_case(contexts, 20, 48, 4, torch.float32)
    q = torch.randn(sum(q_lens), 20, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    starts = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE)
    batch = AttentionBatch(
        slot_mapping=torch.full((13,), PAD_SLOT_ID, dtype=torch.int64, device=DEVICE),  # no store
        num_decode_tokens=2, decode_block_tables=tables[:2], decode_context_lens=lens[:2],
        decode_max_context_len=19, prefill_block_tables=tables[2:], prefill_context_lens=lens[2:],
        prefill_query_start_loc=starts, prefill_max_query_len=7, prefill_max_context_len=12,
    )  # fmt: skip
    assert TRITON_OPS.attention is TritonAttention
    step = TritonAttention(batch, cache, cache, AttentionKind(scale=0.15))
    new = torch.zeros(13, 1, 48, device=DEVICE)
    out = step(q, new, new, cache, cache)
    assert step.latent and step.latent_rows is not None
    assert step.latent_rows[1].tolist() == [9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7]
    decode = dense.paged_decode_attention(q[:2], cache, cache, tables[:2], lens[:2], 0.15, 19)
    prefill = dense.paged_prefill_attention(
        q[2:], cache, cache, tables[2:], lens[2:], starts, 0.15, 7, 12
    )
    torch.testing.assert_close(out, torch.cat((decode, prefill)), atol=2e-5, rtol=2e-5)
