"""W4A16 GEMM: 4-bit weights dequantized tile by tile inside the product, for the on-disk layouts.

One kernel serves the three packings the checkpoints use (see
``quant_reference.py`` for each format's definition):

- GPTQ: ``gptq_linear(x, qweight, qzeros, scales, g_idx)``; qweight int32
  (K/8, N) packed along K, qzeros (G, N/8) stored minus one (v2: as is), optional g_idx
  (act-order: row k's group is g_idx[k]).
- AWQ (GEMM): ``awq_linear(x, qweight, qzeros, scales)``; qweight int32
  (K, N/8) and qzeros (G, N/8) packed along N in AWQ's 0,2,4,6,1,3,5,7 order.
- compressed-tensors pack-quantized: ``pack_quantized_linear(x,
  weight_packed, weight_scale, weight_zero_point)``; weight_packed int32
  (N, K/8) packed along K, values offset by 8, weight_scale (N, G), optional
  weight_zero_point int32 (ceil(N/8), G) packed along N.

A program computes a BLOCK_M x BLOCK_N tile of x @ w: for each BLOCK_K slice
it loads the int32 words holding its BLOCK_K x BLOCK_N nibbles (each word
once, as a tile contiguous along the packed tensor's rows, unpacked by eight
broadcast shifts: a tile of words repeated 8 times per nibble would be laid
out across K, and Triton 3.6 then reads the scales one 16-bit value at a
time), each row's group scale and zero, forms (q - z) * s in the scales' dtype
(the formats' fp16 arithmetic, as ``worker/models/quant/gptq.py`` and ``worker/models/quant/awq.py``
define the weight), casts it to x's dtype and feeds it to tl.dot with fp32
accumulation; the weight is never dequantized whole. Output in x's dtype
(bf16, fp16 or fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import arg_checks


@triton.jit
def _w4a16_kernel(
    x_ptr,  # (M, K)
    qweight_ptr,  # int32 words: (k, n) is at (k // PACK_K) * qw_stride_k + (n // PACK_N) * qw_stride_n
    scales_ptr,  # (g, n) at g * s_stride_g + n * s_stride_n
    zeros_ptr,  # int32 words: (g, n) at g * z_stride_g + (n // 8) * z_stride_n, when HAS_ZEROS
    g_idx_ptr,  # (K,) group of each row, when HAS_G_IDX
    out_ptr,  # (M, N)
    M,
    N,
    K,
    x_stride,
    out_stride,
    qw_stride_k,
    qw_stride_n,
    s_stride_g,
    s_stride_n,
    z_stride_g,
    z_stride_n,
    GROUP_SIZE: tl.constexpr,  # rows per group when not HAS_G_IDX
    PACKED_ALONG_K: tl.constexpr,  # eight rows to a word (GPTQ, compressed-tensors), else columns
    AWQ_ORDER: tl.constexpr,  # column c of a word at bit 4 * (0,4,1,5,2,6,3,7)[c], weights and zeros
    HAS_ZEROS: tl.constexpr,  # else every zero is 8 (symmetric compressed-tensors)
    ZERO_OFFSET: tl.constexpr,  # added to the stored zero (GPTQ stores it minus one)
    HAS_G_IDX: tl.constexpr,
    ONE_GROUP_PER_STEP: tl.constexpr,  # no g_idx and BLOCK_K divides GROUP_SIZE
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # the words holding the tile's nibbles, each loaded once from contiguous addresses and
    # unpacked by broadcasting eight shifts over it: words along N hold 8 columns, along K 8 rows
    offs_wn = tl.program_id(1) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    offs_wk = tl.arange(0, BLOCK_K // 8)
    nibble = tl.arange(0, 8)
    if AWQ_ORDER:
        col_shift = ((nibble % 2) * 4 + nibble // 2) * 4
    else:
        col_shift = nibble * 4
    m_mask, n_mask = offs_m < M, offs_n < N
    wn_mask = offs_wn * 8 < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rows = k0 + offs_k
        k_mask = rows < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if PACKED_ALONG_K:  # (BLOCK_K // 8, BLOCK_N) words -> (BLOCK_K, BLOCK_N) nibbles
            word_rows = k0 // 8 + offs_wk
            words = tl.load(
                qweight_ptr + word_rows[:, None] * qw_stride_k + offs_n[None, :] * qw_stride_n,
                mask=(word_rows * 8 < K)[:, None] & n_mask[None, :],
                other=0,
            )
            q = (words[:, None, :] >> (nibble * 4)[None, :, None]) & 0xF
        else:  # (BLOCK_K, BLOCK_N // 8) words -> (BLOCK_K, BLOCK_N) nibbles
            words = tl.load(
                qweight_ptr + rows[:, None] * qw_stride_k + offs_wn[None, :] * qw_stride_n,
                mask=k_mask[:, None] & wn_mask[None, :],
                other=0,
            )
            q = (words[:, :, None] >> col_shift[None, None, :]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        if ONE_GROUP_PER_STEP:  # the slice's rows share one group: a row of scales and zeros
            group = k0 // GROUP_SIZE
            scales = tl.load(
                scales_ptr + group * s_stride_g + offs_n * s_stride_n, mask=n_mask, other=0.0
            )[None, :]
            zeros = 8  # symmetric: the stored values are offset by 8
            if HAS_ZEROS:
                zero_ptrs = zeros_ptr + group * z_stride_g + offs_wn * z_stride_n
                zero_words = tl.load(zero_ptrs, mask=wn_mask, other=0)  # (BLOCK_N // 8,)
                zeros = (zero_words[:, None] >> col_shift[None, :]) & 0xF
                zeros = tl.reshape(zeros, (1, BLOCK_N)) + ZERO_OFFSET
        else:
            if HAS_G_IDX:
                groups = tl.load(g_idx_ptr + rows, mask=k_mask, other=0)
            else:
                groups = rows // GROUP_SIZE
            scales = tl.load(
                scales_ptr + groups[:, None] * s_stride_g + offs_n[None, :] * s_stride_n,
                mask=w_mask,
                other=0.0,
            )
            zeros = 8
            if HAS_ZEROS:
                z_ptrs = zeros_ptr + groups[:, None] * z_stride_g + offs_wn[None, :] * z_stride_n
                zero_words = tl.load(z_ptrs, mask=k_mask[:, None] & wn_mask[None, :], other=0)
                zeros = (zero_words[:, :, None] >> col_shift[None, None, :]) & 0xF
                zeros = tl.reshape(zeros, (BLOCK_K, BLOCK_N)) + ZERO_OFFSET
        # rounded to the scales' dtype, as the formats define the weight (fp16 for GPTQ and
        # AWQ): the fp32 product of a small integer and the scale is exact, so this is the
        # one rounding of a product in that dtype
        w = (q - zeros).to(tl.float32) * scales.to(tl.float32)
        if scales.dtype == tl.bfloat16:  # to nearest even here: the interpreter's cast truncates
            bits = w.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            w = bits.to(tl.float32, bitcast=True)
        w = w.to(scales.dtype).to(x.dtype)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w, input_precision="ieee")  # "ieee": fp32 x without tf32
        x_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where the kernel finds (k, n)'s nibble, scale and zero in one format's tensors."""

    qweight: torch.Tensor
    qw_strides: tuple[int, int]  # (per word-row along K, per word-column along N)
    scales: torch.Tensor
    s_strides: tuple[int, int]  # (per group, per column)
    zeros: torch.Tensor | None
    z_strides: tuple[int, int]  # (per group, per word of 8 columns)
    g_idx: torch.Tensor | None
    k: int
    n: int
    num_groups: int
    packed_along_k: bool
    awq_order: bool
    zero_offset: int


def _run(x: torch.Tensor, lay: _Layout) -> torch.Tensor:
    arg_checks.check_dtype("x", x, arg_checks.FLOAT_DTYPES)
    arg_checks.check_dtype("scales", lay.scales, arg_checks.FLOAT_DTYPES)
    if x.shape[-1] != lay.k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {lay.k}")
    if lay.g_idx is None and lay.k % lay.num_groups:
        raise ValueError(f"{lay.num_groups} groups do not divide K={lay.k}")
    index = {"g_idx": lay.g_idx} if lay.g_idx is not None else {}
    zeros = {"zeros": lay.zeros} if lay.zeros is not None else {}
    for name, t in {"qweight": lay.qweight, **zeros}.items():
        arg_checks.check_dtype(name, t, (torch.int32,))
    for name, t in index.items():
        arg_checks.check_dtype(name, t, arg_checks.INDEX_DTYPES)
    arg_checks.check_device(x=x, qweight=lay.qweight, scales=lay.scales, **zeros, **index)
    x2 = x.reshape(-1, lay.k).contiguous()
    m = x2.shape[0]
    out = torch.empty((m, lay.n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], lay.n)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 128 if m > 32 else 64
    group_size = lay.k // lay.num_groups
    block_k = 32 if x.dtype == torch.float32 else 64
    if lay.g_idx is None and group_size % block_k and group_size in (16, 32):
        block_k = group_size  # a step within one group: its scales load once
    one_group_per_step = lay.g_idx is None and group_size % block_k == 0
    grid = (triton.cdiv(m, block_m), triton.cdiv(lay.n, block_n))
    _w4a16_kernel[grid](
        x2, lay.qweight, lay.scales, lay.zeros if lay.zeros is not None else lay.qweight,
        lay.g_idx if lay.g_idx is not None else lay.qweight, out,
        m, lay.n, lay.k, x2.stride(0), out.stride(0),
        *lay.qw_strides, *lay.s_strides, *lay.z_strides,
        GROUP_SIZE=group_size, PACKED_ALONG_K=lay.packed_along_k,
        AWQ_ORDER=lay.awq_order, HAS_ZEROS=lay.zeros is not None, ZERO_OFFSET=lay.zero_offset,
        HAS_G_IDX=lay.g_idx is not None, ONE_GROUP_PER_STEP=one_group_per_step,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=arg_checks.dot_in_fp32(x.dtype), num_warps=4, num_stages=3,
    )  # fmt: skip
    return out.view(*x.shape[:-1], lay.n)


def gptq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    zero_offset: int = 1,
) -> torch.Tensor:
    """x (..., K) @ a GPTQ 4-bit weight -> (..., N); qweight (K/8, N), qzeros (G, N/8), scales (G, N).

    zero_offset: added to each stored zero point (1: ``checkpoint_format: gptq``, which
    stores them less one; 0: ``gptq_v2``)."""
    arg_checks.check_dim("qweight", qweight, 2, "(K/8, N)")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    arg_checks.check_shape("scales", scales, (groups, n))
    arg_checks.check_shape("qzeros", qzeros, (groups, n // 8))
    if g_idx is not None:
        arg_checks.check_shape("g_idx", g_idx, (k,))
    return _run(x, _Layout(
        qweight, (qweight.stride(0), qweight.stride(1)), scales, (scales.stride(0), scales.stride(1)),
        qzeros, (qzeros.stride(0), qzeros.stride(1)), g_idx, k, n, groups,
        packed_along_k=True, awq_order=False, zero_offset=zero_offset,
    ))  # fmt: skip


def awq_linear(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """x (..., K) @ an AWQ (GEMM-packed) 4-bit weight -> (..., N); qweight (K, N/8), qzeros (G, N/8), scales (G, N)."""
    arg_checks.check_dim("qweight", qweight, 2, "(K, N/8)")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = scales.shape[0]
    arg_checks.check_shape("scales", scales, (groups, n))
    arg_checks.check_shape("qzeros", qzeros, (groups, n // 8))
    return _run(x, _Layout(
        qweight, (qweight.stride(0), qweight.stride(1)), scales, (scales.stride(0), scales.stride(1)),
        qzeros, (qzeros.stride(0), qzeros.stride(1)), None, k, n, groups,
        packed_along_k=False, awq_order=True, zero_offset=0,
    ))  # fmt: skip


def pack_quantized_linear(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (..., K) @ a compressed-tensors pack-quantized 4-bit weight -> (..., N).

    weight_packed (N, K/8), weight_scale (N, G), weight_zero_point (ceil(N/8), G)
    when asymmetric (None: symmetric, every zero 8 in the stored offset-8 values).
    """
    arg_checks.check_dim("weight_packed", weight_packed, 2, "(N, K/8)")
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    groups = weight_scale.shape[1] if weight_scale.dim() == 2 else 0
    arg_checks.check_shape("weight_scale", weight_scale, (n, groups))
    zp = weight_zero_point
    if zp is not None:
        arg_checks.check_shape("weight_zero_point", zp, (triton.cdiv(n, 8), groups))
    return _run(x, _Layout(
        weight_packed, (weight_packed.stride(1), weight_packed.stride(0)),
        weight_scale, (weight_scale.stride(1), weight_scale.stride(0)),
        zp, (zp.stride(1), zp.stride(0)) if zp is not None else (0, 0), None, k, n, groups,
        packed_along_k=True, awq_order=False, zero_offset=0,
    ))  # fmt: skip
