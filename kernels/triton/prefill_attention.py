"""Paged prefill attention: variable-length query chunks attending causally to
their own new tokens and to the cached context in the pages.

One kernel serves full prompts, chunked prefill, prefix-cache hits and q_len 1
rows: a sequence's new tokens are the last q_len of its context_len tokens,
their K/V already stored, so every key is read from the paged cache.

Grid (num_seqs * num_q_blocks, num_kv_heads), num_q_blocks = cdiv(max_query_len,
BLOCK_Q). A program owns BLOCK_Q query tokens of one sequence times the GROUP
query heads of one KV head, flattened into BLOCK_M = BLOCK_Q * GROUP (+ padding)
rows (row r is token r // GROUP, head r % GROUP), so each K/V tile is loaded once
for the whole GQA group. Programs past their sequence's q_len loop zero times
and store nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import arg_checks
from batchgen.kernels.triton.attention_tile import (
    LOG2E,
    NO_WINDOW,
    fold_sink,
    kv_row_offsets,
    online_softmax_step,
    qk_scores,
    scaled_scores,
)

MAX_HEAD_DIM = 256  # head_dim pads to a power of two <= this (register budget)
MAX_GROUP = 128  # query heads per KV head; BLOCK_M grows to cover the group


@triton.jit
def _prefill_kernel(
    q_ptr,  # (num_tokens, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # same shape and strides as k_cache
    block_tables_ptr,  # (num_seqs, max_blocks_per_seq) int32/int64
    context_lens_ptr,  # (num_seqs,) cached + new tokens
    query_start_loc_ptr,  # (num_seqs + 1,) offsets of each sequence's rows in q
    out_ptr,  # (num_tokens, num_heads, head_dim)
    sinks_ptr,  # (num_heads,) sink logits when HAS_SINKS
    qk_scale,  # softmax scale * log2(e); with SOFTCAP the scale alone
    softcap,
    window,  # a query at p sees keys p - window < j <= p (NO_WINDOW: all of them)
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    block_tables_stride_s,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    num_q_blocks,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0) // num_q_blocks
    q_block = tl.program_id(0) % num_q_blocks
    kv_head = tl.program_id(1)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    first_q = q_block * BLOCK_Q

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_idx = first_q + offs_m // GROUP  # (BLOCK_M,) token index within the chunk
    heads = kv_head * GROUP + offs_m % GROUP  # (BLOCK_M,) query head
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = context_len - q_len + q_idx  # (BLOCK_M,) absolute position: sees keys <= q_pos

    q_ptrs = q_ptr + (q_start + q_idx)[:, None] * q_stride_t + heads[:, None] * q_stride_h
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    # Keys up to the block's last query position; none for an idle program.
    last_q = tl.minimum(first_q + BLOCK_Q, q_len)
    num_keys = tl.where(first_q < q_len, context_len - q_len + last_q, 0)
    # keys before the block's first query's window are never read (their blocks
    # may belong to another sequence by now)
    first_key = tl.maximum(context_len - q_len + first_q - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride_s
    for start in range(first_key // TILE_N * TILE_N, num_keys, TILE_N):
        pos = start + offs_n  # (TILE_N,)
        pos_mask = (pos < num_keys) & (pos >= first_key)
        rows = kv_row_offsets(
            table_row, pos, pos_mask, kv_head,
            cache_stride_b, cache_stride_s, cache_stride_h, BLOCK_SIZE,
        )  # fmt: skip
        k_t = tl.load(  # (HEAD_DIM_PAD, TILE_N)
            k_cache_ptr + rows[None, :] + offs_d[:, None],
            mask=d_mask[:, None] & pos_mask[None, :],
            other=0.0,
        )
        v = tl.load(  # (TILE_N, HEAD_DIM_PAD)
            v_cache_ptr + rows[:, None] + offs_d[None, :],
            mask=pos_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        s = scaled_scores(qk_scores(q, k_t, DOT_FP32), qk_scale, softcap, SOFTCAP)
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        visible = visible & pos_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=float("-inf")).to(tl.float32)
        m_i, l_i, acc = fold_sink(m_i, l_i, acc, sink * 1.4426950408889634)  # log2(e)
    # l_i == 0 (with acc == 0) only in idle programs, whose store is masked anyway.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + (q_start + q_idx)[:, None] * out_stride_t + heads[:, None] * out_stride_h
    tl.store(
        out_ptrs + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length causal attention over the paged context (``dense.paged_prefill_attention``).

    q (num_tokens, num_heads, head_dim) may be a strided view, contiguous in
    head_dim; caches share q's dtype (fp16, bf16 or fp32; fp32 accumulation).
    max_query_len must bound the chunks' lengths (it sizes the grid: rows past
    it are not computed); max_context_len must bound context_lens. Limits:
    head_dim <= 256, at most 128 query heads per KV head. window: a query at
    p sees keys p - window < j <= p, and blocks before its chunk's window are
    not read; softcap: scores -> softcap * tanh(scores / softcap); sinks
    (num_heads,): per-head sink logits (gpt-oss). Returns a new contiguous
    (num_tokens, num_heads, head_dim).
    """
    return prefill_attention(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
        scale, max_query_len, max_context_len, window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_size: int | None = None,
) -> torch.Tensor:
    """``paged_prefill_attention`` with the tile sizes open (tests, benchmarks).

    block_m: query rows (tokens x group heads) per program, a power of two >= 16
    and >= the group; tile_size: keys per loop step, a power of two >= 16.
    """
    shape = check_prefill_args(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
        max_query_len, max_context_len,
    )  # fmt: skip
    arg_checks.check_sinks(sinks, shape)
    return launch_prefill(
        shape, q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
        scale, max_query_len, window=window, softcap=softcap, sinks=sinks, block_m=block_m,
        tile_size=tile_size,
    )  # fmt: skip


def check_prefill_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
) -> arg_checks.PagedAttentionShape:
    shape = arg_checks.check_paged_attention(
        q, k_cache, v_cache, block_tables, context_lens, max_context_len,
        max_head_dim=MAX_HEAD_DIM, max_group=MAX_GROUP, query_start_loc=query_start_loc,
    )  # fmt: skip
    arg_checks.check_shape("query_start_loc", query_start_loc, (block_tables.shape[0] + 1,))
    if max_query_len > max(max_context_len, 0):
        raise ValueError(f"max_query_len {max_query_len} > max_context_len {max_context_len}")
    return shape


def prefill_tiles(max_query_len: int, group: int, head_dim: int) -> tuple[int, int]:
    """(block_m, tile_size) a launch picks: each is compiled on its first use.

    Enough rows for the longest chunk's group, capped at 64 (128 with big
    groups): short decode-like chunks do not pay for 64 rows."""
    block_m = min(arg_checks.pow2(max_query_len * group, 16), arg_checks.pow2(group, 64))
    tile_size = 64 if arg_checks.pow2(head_dim, 16) <= 128 else 32
    return block_m, tile_size


def launch_prefill(
    shape: arg_checks.PagedAttentionShape,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_size: int | None = None,
) -> torch.Tensor:
    """The kernel launch alone, for arguments ``check_prefill_args`` accepted
    (once per step: every layer's arguments have the same shapes and dtypes)."""
    num_tokens, num_seqs = q.shape[0], block_tables.shape[0]
    num_heads, head_dim, group = shape.num_heads, shape.head_dim, shape.group
    device, block_size, num_kv_heads = shape.device, shape.block_size, shape.num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_tokens == 0 or num_seqs == 0 or num_heads == 0 or max_query_len <= 0:
        return out
    head_dim_pad = arg_checks.pow2(head_dim, 16)
    chosen_m, chosen_tile = prefill_tiles(max_query_len, group, head_dim)
    block_m = chosen_m if block_m is None else block_m
    tile_size = chosen_tile if tile_size is None else tile_size
    for name, value in (("block_m", block_m), ("tile_size", tile_size)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if block_m < group:
        raise ValueError(f"block_m {block_m} is smaller than the {group} heads per KV head")
    block_q = block_m // group
    num_q_blocks = triton.cdiv(max_query_len, block_q)
    _prefill_kernel[(num_seqs * num_q_blocks, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
        out if sinks is None else sinks,
        scale if softcap is not None else scale * LOG2E, softcap or 1.0, window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_blocks,
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        TILE_N=tile_size,
        DOT_FP32=arg_checks.dot_in_fp32(q.dtype),
        SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        num_warps=4 if head_dim_pad <= 128 else 8,
    )  # fmt: skip
    return out
