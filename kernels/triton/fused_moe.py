"""Routed experts on the GPU: the (token, slot) pairs sorted by expert, each GEMM one launch.

``sort_by_expert`` lays the pairs out expert by expert, each expert's run
padded to a multiple of BLOCK_M, and records which expert owns each block of
BLOCK_M rows; all on the device, with no host sync, so a step can be captured
in a CUDA graph. ``_grouped_gemm_kernel`` then computes every expert's
product in one launch: grid (max_blocks, cdiv(N, BLOCK_N)), a program takes
one block of rows, all of one expert, gathers their A rows and multiplies them
by that expert's weight tile. Blocks past the last expert's run return at once.

fused_moe = gather x -> GEMM with w13 (+ b13) -> activation -> GEMM with w2
(+ b2), each row weighted by its routing weight -> sum over each token's top_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.experts import ExpertWeights
from batchgen.kernels.triton import activation, arg_checks


@dataclass(slots=True)
class ExpertOrder:
    """The pairs grouped by expert, as the grouped GEMM reads them."""

    sorted_pairs: torch.Tensor  # (num_blocks * block_m,) pair index; num_pairs in padding rows
    block_experts: torch.Tensor  # (num_blocks,) the expert of each block; num_experts past the end
    block_m: int


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertOrder:
    """Pair p (token p // top_k, slot p % top_k) goes to its expert's run, runs padded to block_m.

    At most cdiv(num_pairs, block_m) + min(num_pairs, num_experts) blocks are
    used (each expert with pairs wastes less than one block); that many are
    allocated, so the grid is known without reading the counts back.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)
    # not bincount: on CUDA it reads the largest id back to size its output (a host sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (padded_ends - padded)[expert_of] + rank
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_pairs, num_experts)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[dest] = order
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    return ExpertOrder(sorted_pairs, block_experts, block_m)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # (num_a_rows, K); pair p reads row p // A_ROW_DIV
    w_ptr,  # (num_experts, K, N)
    bias_ptr,  # (num_experts, N) when HAS_BIAS
    out_ptr,  # (num_pairs, N)
    sorted_pairs_ptr,  # (num_blocks * BLOCK_M,)
    block_experts_ptr,  # (num_blocks,)
    weights_ptr,  # (num_pairs,) routing weights when MUL_WEIGHT
    num_pairs,
    num_experts,
    N,
    K,
    a_stride,
    w_stride_e,
    w_stride_k,
    bias_stride_e,
    out_stride,
    A_ROW_DIV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    expert = expert.to(tl.int64)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_mask = pairs < num_pairs
    a_rows = pairs // A_ROW_DIV
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * a_stride + offs_k[None, :]
    w_ptrs = w_ptr + expert * w_stride_e + offs_k[:, None] * w_stride_k + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w, input_precision="ieee")  # "ieee": fp32 operands without tf32
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * bias_stride_e + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def fused_moe(
    x: torch.Tensor,
    experts: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``moe_reference.fused_moe`` on the GPU: x (num_tokens, hidden) -> (num_tokens, hidden).

    x and the expert weights share one float dtype (fp32 accumulation); the
    weights must be contiguous in their last dimension; topk_ids int32/int64
    in [0, num_experts) (the routers' output; not checked on the device).
    """
    _check(x, experts, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, _, inter2 = experts.w13.shape
    hidden = experts.w2.shape[2]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    # Few pairs per expert (decode): small blocks waste less padding.
    block_m = 16 if num_pairs <= 32 * num_experts else 64
    order = sort_by_expert(topk_ids, num_experts, block_m)
    h = torch.empty((num_pairs, inter2), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, experts.w13, experts.b13, h, order, num_pairs, top_k, None)
    if experts.activation is None:
        act = activation.silu_and_mul(h)
    else:
        act = activation.clamped_swiglu(h, experts.activation.alpha, experts.activation.limit)
    pair_out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, experts.w2, experts.b2, pair_out, order, num_pairs, 1, weights)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    order: ExpertOrder,
    num_pairs: int,
    a_row_div: int,
    weights: torch.Tensor | None,
) -> None:
    num_experts, k, n = w.shape
    block_n = min(64, arg_checks.pow2(n, 16))
    block_k = min(64 if a.dtype != torch.float32 else 32, arg_checks.pow2(k, 16))
    grid = (order.block_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, order.sorted_pairs, order.block_experts,
        weights if weights is not None else w,
        num_pairs, num_experts, n, k,
        a.stride(0), w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0,
        out.stride(0),
        A_ROW_DIV=a_row_div, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        BLOCK_M=order.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=arg_checks.dot_in_fp32(a.dtype),
        num_warps=4,
    )  # fmt: skip


def _check(
    x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    arg_checks.check_dim("x", x, 2, "(num_tokens, hidden)")
    arg_checks.check_dim("w13", experts.w13, 3, "(num_experts, hidden, 2 * inter)")
    arg_checks.check_dim("w2", experts.w2, 3, "(num_experts, inter, hidden)")
    arg_checks.check_dim("topk_ids", topk_ids, 2, "(num_tokens, top_k)")
    num_tokens, hidden = x.shape
    num_experts, _, inter2 = experts.w13.shape
    if inter2 % 2:
        raise ValueError(f"w13 must end in an even dimension (gate and up), got {inter2}")
    arg_checks.check_shape("w13", experts.w13, (num_experts, hidden, inter2))
    arg_checks.check_shape("w2", experts.w2, (num_experts, inter2 // 2, hidden))
    if experts.b13 is not None:
        arg_checks.check_shape("b13", experts.b13, (num_experts, inter2))
    if experts.b2 is not None:
        arg_checks.check_shape("b2", experts.b2, (num_experts, hidden))
    if topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows for {num_tokens} tokens")
    arg_checks.check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    arg_checks.check_dtype("x", x, arg_checks.FLOAT_DTYPES)
    arg_checks.check_dtype("topk_weights", topk_weights, arg_checks.FLOAT_DTYPES)
    arg_checks.check_dtype("topk_ids", topk_ids, arg_checks.INDEX_DTYPES)
    tensors = {"x": x, "w13": experts.w13, "w2": experts.w2}
    biases = {"b13": experts.b13, "b2": experts.b2}
    tensors.update({name: b for name, b in biases.items() if b is not None})
    arg_checks.check_same_dtype(**tensors)
    arg_checks.check_device(**tensors, topk_weights=topk_weights, topk_ids=topk_ids)
    arg_checks.check_last_dim_contiguous(**tensors)
