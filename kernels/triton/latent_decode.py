"""Paged decode attention for DeepSeek's multi-head latent attention (MLA), absorbed form.

The cache holds one row per token, [latent | rope key] (kv_lora_rank +
qk_rope_head_dim, 512 + 64 in DeepSeek V2/V3), read both as the key of every
query head and as its value (``worker/models/layers/latent_attention.py``). The generic decode
kernel would hold a whole 576-wide row per head group in registers and
needs 165-524 KB of shared memory at these shapes; this one cuts the row at
a power of two, MAIN_DIM (the latent, 512) and the rest (the rope part, 64),
and the query heads into blocks of HEAD_BLOCK (16, the smallest tl.dot M),
one block per program.

Grid (num_seqs, head_blocks, num_splits). Each context tile is loaded once
per program as (TILE_N, MAIN_DIM) and (TILE_N, REST_PAD) and used twice: as
K^T in the scores q_main @ c^T + q_rest @ r^T and as V in p @ [c | r]. The
output has the row's full width, rope columns included, like the generic
kernels (the caller drops them). With several splits each program writes
partial softmax states that ``split_k.merge_splits_kernel`` combines, once
for the main columns and once for the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import arg_checks
from batchgen.kernels.triton.attention_tile import LOG2E, kv_row_offsets
from batchgen.kernels.triton.split_k import (
    MAX_SPLITS,
    choose_num_splits,
    merge_splits_kernel,
    num_sms,
)

HEAD_BLOCK = 16  # query heads per program
MAX_HEAD_DIM = 768  # MAIN_DIM <= 512 and a rest of <= 256 (register budget)


@triton.jit
def _latent_decode_kernel(
    q_ptr,  # (num_seqs, num_heads, head_dim): [absorbed q_nope | rotated q_pe]
    cache_ptr,  # (num_blocks, block_size, 1, head_dim): [latent | rope key]
    block_tables_ptr,  # (num_seqs, max_blocks_per_seq) int32/int64
    context_lens_ptr,  # (num_seqs,) int32/int64; 0 for padding rows (zeros out)
    out_ptr,  # (num_seqs, num_heads, head_dim), written when NUM_SPLITS == 1
    part_main_ptr,  # (num_seqs, num_heads, NUM_SPLITS, MAIN_DIM) fp32, else
    part_rest_ptr,  # (num_seqs, num_heads, NUM_SPLITS, REST_PAD) fp32
    part_max_ptr,  # (num_seqs, num_heads, NUM_SPLITS) fp32
    part_sum_ptr,  # (num_seqs, num_heads, NUM_SPLITS) fp32
    qk_scale,  # softmax scale * log2(e)
    q_stride_s,
    q_stride_h,
    out_stride_s,
    out_stride_h,
    block_tables_stride_s,
    cache_stride_b,
    cache_stride_s,
    num_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    MAIN_DIM: tl.constexpr,
    REST_DIM: tl.constexpr,
    REST_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_h = tl.arange(0, HEAD_BLOCK)
    offs_m = tl.arange(0, MAIN_DIM)
    offs_r = tl.arange(0, REST_PAD)
    offs_n = tl.arange(0, TILE_N)
    heads = head_block * HEAD_BLOCK + offs_h
    h_mask = heads < num_heads
    r_mask = offs_r < REST_DIM

    q_row = q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h
    q_main = tl.load(q_row + offs_m[None, :], mask=h_mask[:, None], other=0.0)
    q_rest = tl.load(
        q_row + MAIN_DIM + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0
    )
    if DOT_FP32:
        q_main, q_rest = q_main.to(tl.float32), q_rest.to(tl.float32)

    m_i = tl.full([HEAD_BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEAD_BLOCK], dtype=tl.float32)
    acc_main = tl.zeros([HEAD_BLOCK, MAIN_DIM], dtype=tl.float32)
    acc_rest = tl.zeros([HEAD_BLOCK, REST_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq * block_tables_stride_s
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + offs_n
        pos_mask = pos < context_len
        rows = kv_row_offsets(
            table_row, pos, pos_mask, 0, cache_stride_b, cache_stride_s, 0, BLOCK_SIZE
        )
        c = tl.load(cache_ptr + rows[:, None] + offs_m[None, :], mask=pos_mask[:, None], other=0.0)
        r = tl.load(
            cache_ptr + rows[:, None] + MAIN_DIM + offs_r[None, :],
            mask=pos_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            c, r = c.to(tl.float32), r.to(tl.float32)
        s = tl.dot(q_main, tl.trans(c), input_precision="ieee")
        s = tl.dot(q_rest, tl.trans(r), acc=s, input_precision="ieee")
        s = tl.where(pos_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked: p = 0, not NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(c.dtype)  # fp16/bf16 for the tensor-core dot, as in flash attention
        acc_main = tl.dot(p, c, acc=acc_main * alpha[:, None], input_precision="ieee")
        acc_rest = tl.dot(p, r, acc=acc_rest * alpha[:, None], input_precision="ieee")
        m_i = m_new

    if NUM_SPLITS == 1:
        norm = tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # context 0: acc == 0, write zeros
        out_row = out_ptr + seq * out_stride_s + heads[:, None] * out_stride_h
        dtype = out_ptr.dtype.element_ty
        tl.store(out_row + offs_m[None, :], (acc_main / norm).to(dtype), mask=h_mask[:, None])
        tl.store(
            out_row + MAIN_DIM + offs_r[None, :],
            (acc_rest / norm).to(dtype),
            mask=h_mask[:, None] & r_mask[None, :],
        )
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=h_mask)
        tl.store(part_sum_ptr + part, l_i, mask=h_mask)
        main_ptrs = part_main_ptr + part[:, None] * MAIN_DIM + offs_m[None, :]
        tl.store(main_ptrs, acc_main, mask=h_mask[:, None])
        rest_ptrs = part_rest_ptr + part[:, None] * REST_PAD + offs_r[None, :]
        tl.store(rest_ptrs, acc_rest, mask=h_mask[:, None])


def latent_split(head_dim: int) -> tuple[int, int]:
    """(MAIN_DIM, REST_DIM): the largest power of two <= head_dim (>= 16) and what is left."""
    main = 1 << (head_dim.bit_length() - 1)
    return main, head_dim - main


def check_latent_decode_args(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
) -> arg_checks.PagedAttentionShape:
    shape = arg_checks.check_paged_attention(
        q,
        cache,
        cache,
        block_tables,
        context_lens,
        max_context_len,
        max_head_dim=MAX_HEAD_DIM,
        max_group=q.shape[1] if q.dim() == 3 else 1,
    )  # fmt: skip (any number of heads: they are cut into blocks)
    if shape.num_kv_heads != 1:
        raise ValueError(f"the latent cache holds one row per token, got {shape.num_kv_heads}")
    if shape.head_dim < 16:
        raise ValueError(f"head_dim {shape.head_dim} is below the kernel's 16")
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows for {q.shape[0]} sequences"
        )
    return shape


def latent_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    *,
    num_splits: int | None = None,
    tile_size: int = 32,
    num_warps: int = 8,
) -> torch.Tensor:
    """One query token per sequence over its paged latent rows (``dense.paged_decode_attention``
    with ``cache`` as both k_cache and v_cache and one KV head).

    q (num_seqs, num_heads, head_dim), contiguous in head_dim; cache
    (num_blocks, block_size, 1, head_dim) in q's dtype. Returns a new
    (num_seqs, num_heads, head_dim). num_splits: a power of two <= 64, or None
    to choose; tile_size: context tokens per loop step, a power of two >= 16.
    """
    shape = check_latent_decode_args(q, cache, block_tables, context_lens, max_context_len)
    return launch_latent_decode(
        shape, q, cache, block_tables, context_lens, scale, max_context_len,
        num_splits=num_splits, tile_size=tile_size, num_warps=num_warps,
    )  # fmt: skip


def launch_latent_decode(
    shape: arg_checks.PagedAttentionShape,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    *,
    num_splits: int | None = None,
    tile_size: int = 32,
    num_warps: int = 8,
) -> torch.Tensor:
    """The launch alone, for arguments ``check_latent_decode_args`` accepted."""
    num_seqs, num_heads, head_dim = q.shape[0], shape.num_heads, shape.head_dim
    device = shape.device
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=device)
    if num_seqs == 0 or num_heads == 0:
        return out
    head_blocks = triton.cdiv(num_heads, HEAD_BLOCK)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, head_blocks, max_context_len, num_sms(device))
    if num_splits < 1 or num_splits > MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(
            f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}"
        )
    if tile_size < 16 or tile_size & (tile_size - 1):
        raise ValueError(f"tile_size must be a power of two >= 16, got {tile_size}")
    main_dim, rest_dim = latent_split(head_dim)
    rest_pad = arg_checks.pow2(rest_dim, 16)
    if num_splits == 1:
        part_main = part_rest = part_max = part_sum = out  # unused by the kernel
    else:
        f32 = torch.float32
        parts = (num_seqs, num_heads, num_splits)
        part_main = torch.empty((*parts, main_dim), dtype=f32, device=device)
        part_rest = torch.empty((*parts, rest_pad), dtype=f32, device=device)
        part_max = torch.empty(parts, dtype=f32, device=device)
        part_sum = torch.empty_like(part_max)
    _latent_decode_kernel[(num_seqs, head_blocks, num_splits)](
        q, cache, block_tables, context_lens, out, part_main, part_rest, part_max, part_sum,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), cache.stride(0), cache.stride(1), num_heads,
        BLOCK_SIZE=shape.block_size,
        HEAD_BLOCK=HEAD_BLOCK,
        MAIN_DIM=main_dim,
        REST_DIM=rest_dim,
        REST_PAD=rest_pad,
        TILE_N=tile_size,
        NUM_SPLITS=num_splits,
        DOT_FP32=arg_checks.dot_in_fp32(q.dtype),
        num_warps=num_warps,
    )  # fmt: skip
    if num_splits > 1:
        # the main columns, then the rest: out[..., MAIN_DIM:] is a view with out's strides
        for part_acc, target, dim, pad in (
            (part_main, out, main_dim, main_dim),
            (part_rest, out[..., main_dim:], rest_dim, rest_pad),
        ):
            if dim == 0:
                continue
            merge_splits_kernel[(num_seqs, num_heads)](
                target, part_acc, part_max, part_sum, target,
                out.stride(0), out.stride(1), num_heads,
                HEAD_DIM=dim, HEAD_DIM_PAD=pad, NUM_SPLITS=num_splits, HAS_SINKS=False,
            )  # fmt: skip
    return out
