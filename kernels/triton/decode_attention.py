"""Paged decode attention: one query token per sequence over its paged context.

Grid (num_seqs, num_kv_heads, num_splits). A program takes all the query
heads that share one KV head (GQA), so each K/V tile is loaded once for the
group and multiplied on tensor cores as a (GROUP_PAD, head_dim) x
(head_dim, TILE_N) dot; GROUP_PAD is the group padded to >= 16 rows, the
smallest tl.dot M. With several splits each program covers a contiguous share
of its sequence's tiles and writes a partial softmax state that
``split_k.merge_splits_kernel`` combines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import arg_checks
from batchgen.kernels.triton.attention_tile import (
    LOG2E,
    NO_WINDOW,
    kv_row_offsets,
    online_softmax_step,
    qk_scores,
    scaled_scores,
)
from batchgen.kernels.triton.split_k import (
    MAX_SPLITS,
    choose_num_splits,
    merge_splits_kernel,
    num_sms,
)

MAX_HEAD_DIM = 256  # head_dim pads to a power of two <= this (register budget)
MAX_GROUP = 64  # query heads per KV head held in one program


@triton.jit
def _decode_kernel(
    q_ptr,  # (num_seqs, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # same shape and strides as k_cache
    block_tables_ptr,  # (num_seqs, max_blocks_per_seq) int32/int64
    context_lens_ptr,  # (num_seqs,) int32/int64, >= 1 for real sequences
    out_ptr,  # (num_seqs, num_heads, head_dim), written when NUM_SPLITS == 1
    part_acc_ptr,  # (num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PAD) fp32, else
    part_max_ptr,  # (num_seqs, num_heads, NUM_SPLITS) fp32
    part_sum_ptr,  # (num_seqs, num_heads, NUM_SPLITS) fp32
    qk_scale,  # softmax scale * log2(e); with SOFTCAP the scale alone
    softcap,
    window,  # a query sees its last `window` keys (NO_WINDOW: all)
    q_stride_s,
    q_stride_h,
    out_stride_s,
    out_stride_h,
    block_tables_stride_s,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    num_heads,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    # keys before `first_key` slid out of the window: never read (their blocks
    # may belong to another sequence by now)
    first_key = tl.maximum(context_len - window, 0)
    # This split's share of the sequence's tiles; trailing splits of short
    # sequences get an empty range and store the empty state (m_i = -inf, l_i = 0).
    first_tile = first_key // TILE_N
    num_tiles = tl.cdiv(context_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    heads = kv_head * GROUP + offs_g  # (GROUP_PAD,) query heads of this KV head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q_ptrs = q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # (GROUP_PAD, D_PAD)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq * block_tables_stride_s
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n  # (TILE_N,)
        pos_mask = (pos < context_len) & (pos >= first_key)
        rows = kv_row_offsets(
            table_row, pos, pos_mask, kv_head,
            cache_stride_b, cache_stride_s, cache_stride_h, BLOCK_SIZE,
        )  # fmt: skip
        k_t = tl.load(  # (HEAD_DIM_PAD, TILE_N), K transposed for the dot
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
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32)

    if NUM_SPLITS == 1:
        # l_i == 0 only for context_len 0 (padding rows), where acc == 0 too:
        # dividing by 1 there writes zeros, not NaN.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + seq * out_stride_s + heads[:, None] * out_stride_h + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # (GROUP_PAD,)
        tl.store(part_max_ptr + part, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part, l_i, mask=g_mask)
        acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=g_mask[:, None])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged context (``dense.paged_decode_attention``).

    q (num_seqs, num_heads, head_dim) may be a strided view, contiguous in
    head_dim; caches (num_blocks, block_size, num_kv_heads, head_dim) share q's
    dtype (fp16, bf16 or fp32; fp32 accumulation). context_lens count the
    current token; a context of 0 (a padding row) yields zeros. max_context_len
    must bound context_lens; it only picks the number of splits, and any
    choice is correct, so it need not be exact. Limits: head_dim <= 256, at most
    64 query heads per KV head. window: the query sees its last `window` keys,
    and blocks before them are not read; softcap: scores -> softcap *
    tanh(scores / softcap). Returns a new contiguous (num_seqs, num_heads, head_dim).
    """
    return decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len,
        window=window, softcap=softcap,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    tile_size: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """``paged_decode_attention`` with the launch choices open (tests, benchmarks).

    num_splits: a power of two <= 64, or None for ``choose_num_splits``.
    tile_size: context tokens per loop step, a power of two >= 16, or None (64,
    32 for head_dim > 128). num_warps: per program (4 keeps head_dim 128 at
    ~96 registers without spills on sm_90).
    """
    shape = check_decode_args(q, k_cache, v_cache, block_tables, context_lens, max_context_len)
    return launch_decode(
        shape, q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len,
        window=window, softcap=softcap, num_splits=num_splits, tile_size=tile_size,
        num_warps=num_warps,
    )  # fmt: skip


def check_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
) -> arg_checks.PagedAttentionShape:
    shape = arg_checks.check_paged_attention(
        q, k_cache, v_cache, block_tables, context_lens, max_context_len,
        max_head_dim=MAX_HEAD_DIM, max_group=MAX_GROUP,
    )  # fmt: skip
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows for {q.shape[0]} sequences"
        )
    return shape


def launch_decode(
    shape: arg_checks.PagedAttentionShape,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    tile_size: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """The kernel launch alone, for arguments ``check_decode_args`` accepted
    (once per step: every layer's arguments have the same shapes and dtypes)."""
    num_seqs = q.shape[0]
    num_heads, num_kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    device, group, block_size = shape.device, shape.group, shape.block_size
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_seqs == 0 or num_heads == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, num_sms(device))
    if num_splits < 1 or num_splits > MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(
            f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}"
        )
    head_dim_pad = arg_checks.pow2(head_dim, 16)
    if tile_size is None:
        tile_size = 64 if head_dim_pad <= 128 else 32
    if tile_size < 16 or tile_size & (tile_size - 1):
        raise ValueError(f"tile_size must be a power of two >= 16, got {tile_size}")

    if num_splits == 1:
        part_acc = part_max = part_sum = out  # unused by the kernel in this case
    else:
        part_acc = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=device
        )
        part_max = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=device
        )
        part_sum = torch.empty_like(part_max)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_acc, part_max, part_sum,
        scale if softcap is not None else scale * LOG2E, softcap or 1.0, window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=arg_checks.pow2(group, 16),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        TILE_N=tile_size,
        NUM_SPLITS=num_splits,
        DOT_FP32=arg_checks.dot_in_fp32(q.dtype),
        SOFTCAP=softcap is not None,
        num_warps=num_warps,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum,
            out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out
