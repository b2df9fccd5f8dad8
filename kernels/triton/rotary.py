"""Neox-layout rotary embedding for q and k in one launch.

Grid (num_tokens, cdiv(max(num_heads, num_kv_heads), BLOCK_H)): a program
loads its token's cos/sin row once and rotates BLOCK_H heads of q and the same
head range of k (masked past num_kv_heads). Math in fp32 as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import arg_checks

MAX_HEAD_DIM = 512  # head_dim // 2 pads to a power of two; a (BLOCK_H, half) tile per tensor
BLOCK_H = 16  # heads per program: (16, 64) fp32 halves for head_dim 128


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, src_stride_t, src_stride_h, dst_stride_t, dst_stride_h,
    token, heads, num_heads, offs, half, cos, sin,
):  # fmt: skip
    """Rotates the (BLOCK_H, HALF_PAD) tile of heads ``heads`` of one token."""
    mask = (heads < num_heads)[:, None] & (offs < half)[None, :]
    src = src_ptr + token * src_stride_t + heads[:, None] * src_stride_h + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * dst_stride_t + heads[:, None] * dst_stride_h + offs[None, :]
    ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # (num_tokens, num_heads, head_dim)
    k_ptr,  # (num_tokens, num_kv_heads, head_dim)
    q_out_ptr,  # (num_tokens, num_heads, head_dim) contiguous
    k_out_ptr,  # (num_tokens, num_kv_heads, head_dim) contiguous
    positions_ptr,  # (num_tokens,) int64
    cos_ptr,  # (max_positions, head_dim // 2) fp32
    sin_ptr,  # (max_positions, head_dim // 2) fp32
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    q_out_stride_t,
    q_out_stride_h,
    k_out_stride_t,
    k_out_stride_h,
    cos_stride,
    sin_stride,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, HALF_PAD)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * cos_stride + offs, mask=offs < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * sin_stride + offs, mask=offs < HALF, other=0.0)[None, :]
    _rotate_heads(
        q_ptr, q_out_ptr, q_stride_t, q_stride_h, q_out_stride_t, q_out_stride_h,
        token, heads, num_heads, offs, HALF, cos, sin,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, k_stride_t, k_stride_h, k_out_stride_t, k_out_stride_h,
        token, heads, num_kv_heads, offs, HALF, cos, sin,
    )  # fmt: skip


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.apply_rotary``: returns new contiguous (q, k), each in its input dtype.

    q (num_tokens, num_heads, head_dim) and k (num_tokens, num_kv_heads,
    head_dim) may be strided views (e.g. of a fused qkv output), contiguous in
    head_dim; positions (num_tokens,) int64; cos/sin caches (max_positions,
    head_dim // 2) fp32. Positions are not range-checked on the host (that
    would synchronise). Limits: even head_dim <= 512.
    """
    arg_checks.check_dim("q", q, 3, "(num_tokens, num_heads, head_dim)")
    arg_checks.check_dim("k", k, 3, "(num_tokens, num_kv_heads, head_dim)")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)}")
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and <= {MAX_HEAD_DIM}, got {head_dim}")
    half = head_dim // 2
    arg_checks.check_shape("positions", positions, (num_tokens,))
    arg_checks.check_dim("cos_cache", cos_cache, 2, "(max_positions, head_dim // 2)")
    arg_checks.check_shape("sin_cache", sin_cache, tuple(cos_cache.shape))
    if cos_cache.shape[1] != half:
        raise ValueError(f"cos_cache has {cos_cache.shape[1]} columns, head_dim // 2 is {half}")
    arg_checks.check_dtype("q", q, arg_checks.FLOAT_DTYPES)
    arg_checks.check_dtype("k", k, arg_checks.FLOAT_DTYPES)
    arg_checks.check_dtype("positions", positions, (torch.int64,))
    arg_checks.check_dtype("cos_cache", cos_cache, (torch.float32,))
    arg_checks.check_dtype("sin_cache", sin_cache, (torch.float32,))
    device = arg_checks.check_device(
        q=q, k=k, positions=positions, cos_cache=cos_cache, sin_cache=sin_cache
    )
    arg_checks.check_last_dim_contiguous(
        q=q, k=k, positions=positions, cos_cache=cos_cache, sin_cache=sin_cache
    )

    q_out = torch.empty(q.shape, dtype=q.dtype, device=device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=device)
    if num_tokens == 0 or max(num_heads, num_kv_heads) == 0:
        return q_out, k_out
    grid = (num_tokens, triton.cdiv(max(num_heads, num_kv_heads), BLOCK_H))
    _rotary_kernel[grid](
        q, k, q_out, k_out, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_cache.stride(0), sin_cache.stride(0),
        num_heads, num_kv_heads,
        HALF=half,
        HALF_PAD=arg_checks.pow2(half),
        BLOCK_H=BLOCK_H,
    )  # fmt: skip
    return q_out, k_out
