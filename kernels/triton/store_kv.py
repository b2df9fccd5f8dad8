"""store_kv: new K/V rows into the paged cache through the slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.reference import PAD_SLOT_ID
from batchgen.kernels.triton import arg_checks

# head_dim is padded to a power of two for tl.arange; beyond this the program's
# registers spill (no model of the Llama family goes past 256).
MAX_HEAD_DIM = 256


@triton.jit
def _store_kv_kernel(
    key_ptr,  # (num_tokens, num_kv_heads, head_dim)
    value_ptr,  # (num_tokens, num_kv_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping_ptr,  # (num_tokens,) int64
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    k_cache_stride_b,
    k_cache_stride_s,
    k_cache_stride_h,
    v_cache_stride_b,
    v_cache_stride_s,
    v_cache_stride_h,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAD_SLOT: tl.constexpr,
):
    # One program per (token, block of BLOCK_H kv heads): a (BLOCK_H, HEAD_DIM_PAD)
    # tile of K and one of V, wide enough for 16-byte vector loads per thread.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # Padding tokens write nothing: a masked store with no valid lanes, not a
    # branch. (A scalar & vector mask also trips the Triton 3.9 interpreter.)
    d_limit = tl.where(slot == PAD_SLOT, 0, HEAD_DIM)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < d_limit)[None, :]

    k_src = key_ptr + token * key_stride_t + heads[:, None] * key_stride_h
    v_src = value_ptr + token * value_stride_t + heads[:, None] * value_stride_h
    k = tl.load(k_src + offs_d[None, :], mask=mask)
    v = tl.load(v_src + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * k_cache_stride_b + offset * k_cache_stride_s
    v_dst = v_cache_ptr + block * v_cache_stride_b + offset * v_cache_stride_s
    tl.store(k_dst + heads[:, None] * k_cache_stride_h + offs_d[None, :], k, mask=mask)
    tl.store(v_dst + heads[:, None] * v_cache_stride_h + offs_d[None, :], v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key/value (num_tokens, num_kv_heads, head_dim) into their cache slots.

    Same contract as ``reference.store_kv``; slots equal to PAD_SLOT_ID are
    skipped. key/value may be strided views (e.g. of a fused qkv output) but
    must be contiguous in head_dim; caches (num_blocks, block_size,
    num_kv_heads, head_dim) likewise. Limits: head_dim <= 256. Slots are not
    range-checked on the host (that would synchronise); out-of-range slots are
    the caller's bug, as they are an IndexError in the reference.
    """
    arg_checks.check_dim("key", key, 3, "(num_tokens, num_kv_heads, head_dim)")
    arg_checks.check_dim("k_cache", k_cache, 4, "(num_blocks, block_size, num_kv_heads, head_dim)")
    num_tokens, num_kv_heads, head_dim = key.shape
    arg_checks.check_shape("value", value, tuple(key.shape))
    arg_checks.check_shape("v_cache", v_cache, tuple(k_cache.shape))
    arg_checks.check_shape("slot_mapping", slot_mapping, (num_tokens,))
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k_cache heads/head_dim {tuple(k_cache.shape[2:])} do not match key's "
            f"{(num_kv_heads, head_dim)}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} exceeds the kernel limit {MAX_HEAD_DIM}")
    arg_checks.check_dtype("key", key, arg_checks.FLOAT_DTYPES)
    arg_checks.check_same_dtype(key=key, value=value, k_cache=k_cache, v_cache=v_cache)
    arg_checks.check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    arg_checks.check_device(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )
    arg_checks.check_last_dim_contiguous(
        key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping
    )
    if num_tokens == 0 or num_kv_heads == 0:
        return
    head_dim_pad = arg_checks.pow2(head_dim)
    # ~1024 elements per program (8 heads of 128), >= 8 per thread
    block_h = min(arg_checks.pow2(num_kv_heads), max(1, 1024 // head_dim_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAD_SLOT=PAD_SLOT_ID,
        num_warps=max(1, min(4, block_h * head_dim_pad // 256)),
    )  # fmt: skip
