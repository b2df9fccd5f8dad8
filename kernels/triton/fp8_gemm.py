"""Block-scaled FP8 GEMM (w8a8), as DeepSeek-V3 and the Qwen3 -FP8 releases run their linears.

The checkpoint's ``weight`` is float8_e4m3fn (N, K) with ``weight_scale_inv``
fp32 (ceil(N/bn), ceil(K/bk)): each entry multiplies its bn x bk block
(``weight_block_size``, [128, 128] in every release; grids whose blocks do not
divide N or K cover a shorter last block). At run time the activations are
quantized to e4m3 per token and group of bk columns (``per_token_group_quant_fp8``,
scale = max|x| / 448), and the GEMM multiplies e4m3 tiles on the tensor cores,
each bk-deep product scaled by its activation and weight scales into an fp32
accumulator; the output is x's dtype. ``quant_reference.w8a8_block_fp8_linear``
is the same math in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.quant_reference import FP8_EPS, FP8_MAX
from batchgen.kernels.triton import arg_checks


@triton.jit
def _round_to_e4m3(v):
    """fp32 in (-464, 464) -> the nearest e4m3 value (ties to even), still fp32.

    The cast that follows is then exact. The Triton interpreter's own fp32 ->
    e4m3 cast drops the carry when rounding up crosses a power of two (31.2 ->
    16, not 32); the GPU's cvt rounds right, and this gives its result on both.
    """
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exponent = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; subnormals below 2^-6
    ulp = ((ulp_exponent + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, ties to even
    return ((v / ulp + magic) - magic) * ulp


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr,  # (M, K)
    q_ptr,  # (M, K) float8_e4m3fn
    s_ptr,  # (M, num_groups) fp32
    K,
    x_stride,
    q_stride,
    num_groups,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,  # GROUP rounded up to a power of two
    EPS: tl.constexpr,
    QMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)), EPS) / QMAX
    # no clamp to +-448 needed: |x| <= amax and the scale is a normal fp32 (>= EPS / 448)
    # within 2 ulps of amax / 448, so |x / scale| < 448 * (1 + 2^-21), which rounds to 448;
    # only >= 464 would round past e4m3's largest value
    q = _round_to_e4m3(tl.math.div_rn(x, scale))
    tl.store(q_ptr + row * q_stride + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * num_groups + group, scale)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (float8_e4m3fn (M, K), fp32 scales (M, ceil(K/group_size))).

    ``quant_reference.per_token_group_quant_fp8`` on the GPU, bit for bit.
    """
    arg_checks.check_dim("x", x, 2, "(num_tokens, K)")
    arg_checks.check_dtype("x", x, arg_checks.FLOAT_DTYPES)
    arg_checks.check_device(x=x)
    arg_checks.check_last_dim_contiguous(x=x)
    m, k = x.shape
    groups = triton.cdiv(k, group_size)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m and k:
        _per_token_group_quant_kernel[(m, groups)](
            x, q, scales, k, x.stride(0), q.stride(0), groups,
            GROUP=group_size, BLOCK=arg_checks.pow2(group_size), EPS=FP8_EPS, QMAX=FP8_MAX,
            num_warps=1 if group_size <= 256 else 4,
        )  # fmt: skip
    return q, scales


@triton.jit
def _w8a8_block_fp8_kernel(
    a_ptr,  # (M, K) e4m3
    b_ptr,  # (N, K) e4m3
    out_ptr,  # (M, N)
    a_scale_ptr,  # (M, cdiv(K, GROUP_K)) fp32
    b_scale_ptr,  # (cdiv(N, GROUP_N), cdiv(K, GROUP_K)) fp32
    M,
    N,
    K,
    a_stride,
    b_stride,
    out_stride,
    a_scale_stride,
    b_scale_stride,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_K: one scale pair per step
    DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * a_stride + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * b_stride + offs_k[:, None]
    a_scale_ptrs = a_scale_ptr + offs_m.to(tl.int64) * a_scale_stride
    b_scale_ptrs = b_scale_ptr + (offs_n // GROUP_N) * b_scale_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        group = k0 // GROUP_K
        a_scale = tl.load(a_scale_ptrs + group, mask=m_mask, other=0.0)
        b_scale = tl.load(b_scale_ptrs + group, mask=n_mask, other=0.0)
        if DOT_FP32:
            partial = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            partial = tl.dot(a, b)
        acc += partial * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8_block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """x (..., K) bf16/fp16/fp32 @ the checkpoint's e4m3 ``weight`` (N, K).T -> (..., N) in x's dtype.

    ``weight_scale_inv`` float (ceil(N/bn), ceil(K/bk)) for ``block_size``
    (bn, bk), the config's ``weight_block_size``; bk a power of two >= 16.
    """
    bn, bk = block_size
    if bk < 16 or bk & (bk - 1) or bn < 1:
        raise ValueError(f"weight_block_size {list(block_size)}: bk must be a power of two >= 16")
    arg_checks.check_dim("weight", weight, 2, "(N, K)")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {k}")
    arg_checks.check_shape("weight_scale_inv", weight_scale_inv, (triton.cdiv(n, bn), triton.cdiv(k, bk)))  # fmt: skip
    arg_checks.check_dtype("weight", weight, (torch.float8_e4m3fn,))
    arg_checks.check_dtype("weight_scale_inv", weight_scale_inv, arg_checks.FLOAT_DTYPES)
    arg_checks.check_device(x=x, weight=weight, weight_scale_inv=weight_scale_inv)
    arg_checks.check_last_dim_contiguous(weight=weight, weight_scale_inv=weight_scale_inv)
    x2 = x.reshape(-1, k).contiguous()
    x_q, x_s = per_token_group_quant_fp8(x2, bk)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        block_m = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
        block_n, block_k = 128, min(bk, 128)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _w8a8_block_fp8_kernel[grid](
            x_q, weight, out, x_s, weight_scale_inv, m, n, k,
            x_q.stride(0), weight.stride(0), out.stride(0), x_s.stride(0), weight_scale_inv.stride(0),
            GROUP_N=bn, GROUP_K=bk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_FP32=arg_checks.dot_in_fp32(weight.dtype), num_warps=4 if block_m <= 64 else 8, num_stages=3,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)
