"""Device helpers shared by the paged attention kernels: gather a K/V tile
through the block table and fold it into an online softmax (flash attention).

Scores live in the log2 domain (the host folds log2(e) into the scale) so the
kernels use exp2, which maps to one hardware instruction.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2E = math.log2(math.e)
# The window passed for layers without one: wider than any context, so every
# key of the causal context is inside it.
NO_WINDOW = 1 << 30


@triton.jit
def scaled_scores(s, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw q.k (M, N) -> log2-domain scores. Without SOFTCAP qk_scale is scale * log2(e);
    with it, qk_scale is the scale and the capped score softcap * tanh(s / softcap)
    is taken to the log2 domain after (tanh as 2 sigmoid(2x) - 1)."""
    if SOFTCAP:
        x = s * qk_scale / softcap
        return softcap * (2.0 * tl.sigmoid(2.0 * x) - 1.0) * 1.4426950408889634
    return s * qk_scale


@triton.jit
def kv_row_offsets(
    block_table_row_ptr,  # this sequence's row of block_tables, (max_blocks_per_seq,)
    pos,  # (TILE_N,) token positions in the sequence
    pos_mask,  # (TILE_N,) positions inside the context
    kv_head,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    BLOCK_SIZE: tl.constexpr,
):
    """(TILE_N,) int64 element offsets of each position's head row in the cache.

    Each position looks its block id up itself, so a tile may span several
    pages and TILE_N is independent of block_size. Masked positions read
    block 0 (never dereferenced: their loads are masked too).
    """
    block = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0)
    block = block.to(tl.int64)  # block_id * stride_b overflows int32 on big caches
    return block * cache_stride_b + (pos % BLOCK_SIZE) * cache_stride_s + kv_head * cache_stride_h


@triton.jit
def qk_scores(q, k_t, DOT_FP32: tl.constexpr):
    """q (M, D) @ k_t (D, N) -> (M, N) fp32; fp16/bf16 operands on tensor cores."""
    if DOT_FP32:
        return tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
    # "ieee" only matters for fp32 operands (no tf32 rounding); ignored otherwise.
    return tl.dot(q, k_t, input_precision="ieee")


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, DOT_FP32: tl.constexpr):
    """Folds one tile into the running softmax state.

    s (M, N) fp32 log2-domain scores, -inf where masked; m_i (M,) running max;
    l_i (M,) running sum of exp2(s - m_i); acc (M, D) fp32 running p @ v;
    v (N, D) in the cache dtype. Returns the new (m_i, l_i, acc).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen only masked scores keeps m = -inf; subtracting 0
    # instead gives p = 0 and alpha = 0 rather than NaN from (-inf) - (-inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        # p is rounded to the cache dtype for the tensor-core dot, as in flash attention.
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
