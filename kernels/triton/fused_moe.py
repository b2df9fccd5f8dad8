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

MXFP4 experts (gpt-oss's ``*_blocks``/``*_scales``, ``Mxfp4ExpertWeights``) run
through the same kernel: each weight tile is read as its e2m1 bytes and e8m0
scales and turned into x's dtype in registers (exact: an e2m1 value times a
power of two fits bf16), gate_up's interleaved rows read in gate-then-up order.
Block-wise FP8 experts (``Fp8BlockExpertWeights``) too: e4m3 bytes times their
block's fp32 scale, rounded to x's dtype, up's rows on up's own scale grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from batchgen.kernels.experts import (
    ExpertWeights,
    Fp8BlockExpertWeights,
    Mxfp4ExpertWeights,
    QuantizedExpertWeights,
    RoutedExperts,
)
from batchgen.kernels.quant_reference import dequantize_experts
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
def _e2m1_times_e8m0(nibbles, scale_bits):
    """MXFP4 values: e2m1 codes (0..15, sign bit 8) times 2^(scale_bits - 127), in fp32."""
    exponent = (nibbles >> 1) & 3
    mantissa = (nibbles & 1).to(tl.float32)
    power = (1 << tl.maximum(exponent - 1, 0)).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * power)
    value = tl.where(nibbles >= 8, -magnitude, magnitude)
    scale = (scale_bits << 23).to(tl.float32, bitcast=True)  # e8m0 is an fp32 exponent
    scale = tl.where(scale_bits == 0, 5.877471754111438e-39, scale)  # 2^-127, subnormal
    return value * scale


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # (num_a_rows, K); pair p reads row p // A_ROW_DIV
    w_ptr,  # (num_experts, K, N); MXFP4: uint8 (num_experts, N', K / 2) e2m1 pairs; FP8_BLOCK: e4m3 (num_experts, N, K)
    w_scales_ptr,  # MXFP4: uint8 (num_experts, N', K / 32) e8m0; FP8_BLOCK: fp32 block grid
    bias_ptr,  # (num_experts, N') when HAS_BIAS
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
    w_stride_k,  # MXFP4: the stride of a weight row (N')
    w_scales_stride_e,
    w_scales_stride_n,
    bias_stride_e,
    out_stride,
    split_n,  # FP8_BLOCK: rows from split_n on (up's) take scale rows from split_rows on
    split_rows,
    A_ROW_DIV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    MXFP4: tl.constexpr,  # the weight as gpt-oss stores it, dequantized tile by tile
    INTERLEAVED_N: tl.constexpr,  # output column n < N/2 is stored row 2n, else row 2(n - N/2) + 1
    FP8_BLOCK: tl.constexpr,  # e4m3 weights, output-major, each GROUP_N x GROUP_K block scaled
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
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
    if INTERLEAVED_N:
        w_rows = tl.where(offs_n < N // 2, 2 * offs_n, 2 * (offs_n - N // 2) + 1)
    else:
        w_rows = offs_n
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * a_stride + offs_k[None, :]
    w_ptrs = w_ptr + expert * w_stride_e + offs_k[:, None] * w_stride_k + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if MXFP4:
            ks = k0 + offs_k
            bytes_ptrs = w_ptr + expert * w_stride_e + w_rows[None, :] * w_stride_k
            packed = tl.load(bytes_ptrs + (ks // 2)[:, None], mask=w_mask, other=0).to(tl.int32)
            nibbles = (packed >> ((ks % 2) * 4)[:, None]) & 0xF  # low nibble: even k
            scales_ptrs = (
                w_scales_ptr + expert * w_scales_stride_e + w_rows[None, :] * w_scales_stride_n
            )
            scale_bits = tl.load(scales_ptrs + (ks // 32)[:, None], mask=w_mask, other=0).to(
                tl.int32
            )
            w = _e2m1_times_e8m0(nibbles, scale_bits).to(a.dtype)
        elif FP8_BLOCK:  # fp8 x its block's scale in fp32, then a's dtype: the CPU path's values
            ks = k0 + offs_k
            row_ptrs = w_ptr + expert * w_stride_e + offs_n[None, :].to(tl.int64) * w_stride_k
            w8 = tl.load(row_ptrs + ks[:, None], mask=w_mask, other=0.0).to(tl.float32)
            scale_rows = tl.where(
                offs_n < split_n, offs_n // GROUP_N, split_rows + (offs_n - split_n) // GROUP_N
            )
            scales_ptrs = (
                w_scales_ptr + expert * w_scales_stride_e + scale_rows[None, :] * w_scales_stride_n
            )
            scale = tl.load(scales_ptrs + (ks // GROUP_K)[:, None], mask=w_mask, other=0.0)
            w = (w8 * scale).to(a.dtype)
        else:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w, input_precision="ieee")  # "ieee": fp32 operands without tf32
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * bias_stride_e + w_rows, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def fused_moe(
    x: torch.Tensor,
    experts: RoutedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``moe_reference.fused_moe`` on the GPU: x (num_tokens, hidden) -> (num_tokens, hidden).

    x and float expert weights share one float dtype (fp32 accumulation); the
    weights must be contiguous in their last dimension; topk_ids int32/int64
    in [0, num_experts) (the routers' output; not checked on the device).
    ``Mxfp4ExpertWeights`` (gpt-oss's checkpoint tensors) and ``Fp8BlockExpertWeights``
    (e4m3 and a block's fp32 scale, the CPU path's values: fp32 products rounded to x's
    dtype) are dequantized to x's dtype tile by tile inside the GEMMs, never whole. GPTQ /
    AWQ / compressed-tensors experts have no kernel here: the loader dequantizes them off
    the CPU (``worker/models/quant/quantized_experts.py``), and experts given to this
    function as stored are dequantized whole, for the call.
    """
    if isinstance(experts, QuantizedExpertWeights):
        plain = dequantize_experts(experts)
        experts = ExpertWeights(
            plain.w13.to(x.dtype), plain.w2.to(x.dtype), activation=plain.activation
        )
    if isinstance(experts, Fp8BlockExpertWeights):
        _check_fp8(x, experts, topk_weights, topk_ids)
        inter, bn = experts.gate_up.shape[1] // 2, experts.block[0]
        gate_up = _Weight(experts.gate_up, experts.gate_up_scale_inv, None, False,
                          experts.block, (inter, -(-inter // bn)))  # fmt: skip
        down = _Weight(experts.down, experts.down_scale_inv, None, False, experts.block)
    elif isinstance(experts, Mxfp4ExpertWeights):
        _check_mxfp4(x, experts, topk_weights, topk_ids)
        gate_up = _Weight(
            experts.gate_up_blocks, experts.gate_up_scales, experts.gate_up_bias, True
        )
        down = _Weight(experts.down_blocks, experts.down_scales, experts.down_bias, False)
    else:
        _check(x, experts, topk_weights, topk_ids)
        gate_up = _Weight(experts.w13, None, experts.b13, False)
        down = _Weight(experts.w2, None, experts.b2, False)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter2, hidden = experts.num_experts, gate_up.n, down.n
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    # Few pairs per expert (decode): small blocks waste less padding.
    block_m = 16 if num_pairs <= 32 * num_experts else 64
    order = sort_by_expert(topk_ids, num_experts, block_m)
    h = torch.empty((num_pairs, inter2), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, h, order, num_pairs, top_k, None)
    if experts.activation is None:
        act = activation.silu_and_mul(h)
    else:
        act = activation.clamped_swiglu(h, experts.activation.alpha, experts.activation.limit)
    pair_out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, down, pair_out, order, num_pairs, 1, weights)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


@dataclass(frozen=True, slots=True)
class _Weight:
    """One projection of every expert: a float (E, K, N) weight, or MXFP4 blocks (E, N, K/32, 16)."""

    w: torch.Tensor
    scales: torch.Tensor | None  # MXFP4's (E, N, K/32) e8m0; None: w is float
    bias: torch.Tensor | None  # (E, N)
    interleaved: bool  # MXFP4 gate_up: rows alternate gate and up
    block: tuple[int, int] | None = None  # FP8 (bn, bk): w is e4m3 (E, N, K), scales its grid
    split: tuple[int, int] | None = None  # FP8 gate_up: (gate's rows, gate's rows of scales)

    @property
    def n(self) -> int:
        return self.w.shape[1] if self.scales is not None else self.w.shape[2]

    @property
    def k(self) -> int:
        if self.block is not None:
            return self.w.shape[2]
        return self.w.shape[2] * 32 if self.scales is not None else self.w.shape[1]


def _grouped_gemm(
    a: torch.Tensor,
    weight: _Weight,
    out: torch.Tensor,
    order: ExpertOrder,
    num_pairs: int,
    a_row_div: int,
    weights: torch.Tensor | None,
) -> None:
    w, scales, bias = weight.w, weight.scales, weight.bias
    num_experts, n, k = w.shape[0], weight.n, weight.k
    block, split = weight.block or (1, 1), weight.split or (n, 0)
    block_n = min(64, arg_checks.pow2(n, 16))
    block_k = min(64 if a.dtype != torch.float32 else 32, arg_checks.pow2(k, 16))
    grid = (order.block_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, scales if scales is not None else w, bias if bias is not None else w, out,
        order.sorted_pairs, order.block_experts, weights if weights is not None else w,
        num_pairs, num_experts, n, k,
        a.stride(0), w.stride(0), w.stride(1),
        scales.stride(0) if scales is not None else 0, scales.stride(1) if scales is not None else 0,
        bias.stride(0) if bias is not None else 0, out.stride(0), *split,
        A_ROW_DIV=a_row_div, HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        MXFP4=scales is not None and weight.block is None, INTERLEAVED_N=weight.interleaved,
        FP8_BLOCK=weight.block is not None, GROUP_N=block[0], GROUP_K=block[1],
        BLOCK_M=order.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=arg_checks.dot_in_fp32(a.dtype),
        num_warps=4,
    )  # fmt: skip


def _check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    arg_checks.check_dim("x", x, 2, "(num_tokens, hidden)")
    arg_checks.check_dim("topk_ids", topk_ids, 2, "(num_tokens, top_k)")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows for {x.shape[0]} tokens")
    arg_checks.check_shape("topk_weights", topk_weights, tuple(topk_ids.shape))
    arg_checks.check_dtype("x", x, arg_checks.FLOAT_DTYPES)
    arg_checks.check_dtype("topk_weights", topk_weights, arg_checks.FLOAT_DTYPES)
    arg_checks.check_dtype("topk_ids", topk_ids, arg_checks.INDEX_DTYPES)


def _check(
    x: torch.Tensor, experts: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    _check_routing(x, topk_weights, topk_ids)
    arg_checks.check_dim("w13", experts.w13, 3, "(num_experts, hidden, 2 * inter)")
    arg_checks.check_dim("w2", experts.w2, 3, "(num_experts, inter, hidden)")
    hidden = x.shape[1]
    num_experts, _, inter2 = experts.w13.shape
    if inter2 % 2:
        raise ValueError(f"w13 must end in an even dimension (gate and up), got {inter2}")
    arg_checks.check_shape("w13", experts.w13, (num_experts, hidden, inter2))
    arg_checks.check_shape("w2", experts.w2, (num_experts, inter2 // 2, hidden))
    if experts.b13 is not None:
        arg_checks.check_shape("b13", experts.b13, (num_experts, inter2))
    if experts.b2 is not None:
        arg_checks.check_shape("b2", experts.b2, (num_experts, hidden))
    tensors = {"x": x, "w13": experts.w13, "w2": experts.w2}
    biases = {"b13": experts.b13, "b2": experts.b2}
    tensors.update({name: b for name, b in biases.items() if b is not None})
    arg_checks.check_same_dtype(**tensors)
    arg_checks.check_device(**tensors, topk_weights=topk_weights, topk_ids=topk_ids)
    arg_checks.check_last_dim_contiguous(**tensors)


def _check_mxfp4(
    x: torch.Tensor, experts: Mxfp4ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    _check_routing(x, topk_weights, topk_ids)
    arg_checks.check_dim("gate_up_blocks", experts.gate_up_blocks, 4, "(num_experts, 2 * inter, hidden / 32, 16)")  # fmt: skip
    arg_checks.check_dim("down_blocks", experts.down_blocks, 4, "(num_experts, hidden, inter / 32, 16)")  # fmt: skip
    hidden = x.shape[1]
    num_experts, inter2 = experts.gate_up_blocks.shape[:2]
    if hidden % 32 or inter2 % 64:
        raise ValueError(f"MXFP4 experts need hidden and inter multiples of 32, got {hidden}, {inter2 // 2}")  # fmt: skip
    shapes = {
        "gate_up_blocks": (experts.gate_up_blocks, (num_experts, inter2, hidden // 32, 16)),
        "gate_up_scales": (experts.gate_up_scales, (num_experts, inter2, hidden // 32)),
        "down_blocks": (experts.down_blocks, (num_experts, hidden, inter2 // 64, 16)),
        "down_scales": (experts.down_scales, (num_experts, hidden, inter2 // 64)),
    }
    for name, (t, shape) in shapes.items():
        arg_checks.check_shape(name, t, shape)
        arg_checks.check_dtype(name, t, (torch.uint8,))
        if t.stride(-1) != 1 or (t.dim() == 4 and t.stride(-2) != 16):
            raise ValueError(
                f"{name} must be contiguous in its last dimensions (stride {t.stride()})"
            )
    biases: dict[str, torch.Tensor] = {}
    if experts.gate_up_bias is not None:
        arg_checks.check_shape("gate_up_bias", experts.gate_up_bias, (num_experts, inter2))
        biases["gate_up_bias"] = experts.gate_up_bias
    if experts.down_bias is not None:
        arg_checks.check_shape("down_bias", experts.down_bias, (num_experts, hidden))
        biases["down_bias"] = experts.down_bias
    arg_checks.check_same_dtype(x=x, **biases)
    blocks = {name: t for name, (t, _) in shapes.items()}
    arg_checks.check_device(x=x, **blocks, **biases, topk_weights=topk_weights, topk_ids=topk_ids)
    arg_checks.check_last_dim_contiguous(x=x, **biases)


def _check_fp8(
    x: torch.Tensor, experts: Fp8BlockExpertWeights, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:  # fmt: skip
    _check_routing(x, topk_weights, topk_ids)
    arg_checks.check_dim("gate_up", experts.gate_up, 3, "(num_experts, 2 * inter, hidden)")
    num_experts, inter2, hidden = experts.gate_up.shape
    (bn, bk), inter = experts.block, inter2 // 2
    grid = (num_experts, 2 * -(-inter // bn), -(-hidden // bk))
    shapes = {
        "gate_up": (experts.gate_up, (num_experts, inter2, hidden), (torch.float8_e4m3fn,)),
        "gate_up_scale_inv": (experts.gate_up_scale_inv, grid, (torch.float32,)),
        "down": (experts.down, (num_experts, hidden, inter), (torch.float8_e4m3fn,)),
        "down_scale_inv": (experts.down_scale_inv,
                           (num_experts, -(-hidden // bn), -(-inter // bk)), (torch.float32,)),
    }  # fmt: skip
    for name, (t, shape, dtypes) in shapes.items():
        arg_checks.check_shape(name, t, shape)
        arg_checks.check_dtype(name, t, dtypes)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (stride {t.stride()})")
    arg_checks.check_device(x=x, **{n: t for n, (t, _, _) in shapes.items()},
                            topk_weights=topk_weights, topk_ids=topk_ids)  # fmt: skip
