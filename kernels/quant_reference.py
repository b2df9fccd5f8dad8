"""Quantized checkpoint tensors dequantized the plainest way, in torch and fp32.

The oracle the quantized Triton GEMMs (``triton/fp8_gemm.py``,
``triton/w4a16_gemm.py``, MXFP4 in ``triton/fused_moe.py``) are tested
against: each format's tensors exactly as the checkpoint stores them on disk,
turned into the float weight they stand for, a few lines each, right by
inspection of the format's definition.

Formats (the tensor names are the checkpoints'):
- FP8 block-wise (DeepSeek-V3, Qwen3 -FP8; ``quant_method: fp8``): ``weight``
  float8_e4m3fn (N, K), ``weight_scale_inv`` fp32 (ceil(N/bn), ceil(K/bk)) whose
  entry multiplies its bn x bk block of the weight; activations are quantized
  at run time per token and group of bk columns (``per_token_group_quant_fp8``).
  Routed experts: one such pair per expert and projection (``Fp8BlockExpertWeights``).
  GPTQ, AWQ and compressed-tensors routed experts (``QuantizedExpertWeights``) keep
  one of the weights below per expert and projection, each dequantizing itself.
- GPTQ: ``qweight`` int32 (K/8, N), row k's 4 bits at bit 4*(k%8) of word k//8;
  ``qzeros`` int32 (G, N/8), column n's at bit 4*(n%8), stored minus one (the
  original "gptq" checkpoint format); ``scales`` (G, N); ``g_idx`` (K,) the group
  of each row (act-order), else row k is in group k // (K/G).
- AWQ (GEMM packing): ``qweight`` int32 (K, N/8) and ``qzeros`` (G, N/8), eight
  columns to a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (column 8j+c at bit
  4*AWQ_SHIFT_SLOT[c]); ``scales`` (G, N); w = (q - z) * s.
- The 4-bit formats form (q - z) * s in the scales' dtype (fp16 as GPTQ and AWQ
  save them; their kernels' arithmetic), one rounding of an exact product.
- compressed-tensors pack-quantized (W4A16): ``weight_packed`` int32 (N, K/8),
  column k's at bit 4*(k%8), the signed value plus 8; ``weight_scale`` (N, G);
  ``weight_zero_point`` int32 (ceil(N/8), G), packed along N the same way, when
  asymmetric; w = (q - zp) * s.
- MXFP4 (gpt-oss experts): ``*_blocks`` uint8 (E, N, K/32, 16), two e2m1 values
  a byte (the low nibble first), ``*_scales`` uint8 (E, N, K/32), e8m0: 2^(s-127).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.kernels.experts import (
    ExpertWeights,
    Fp8BlockExpertWeights,
    Mxfp4ExpertWeights,
    QuantizedExpertWeights,
)

FP8_MAX = 448.0  # largest float8_e4m3fn
FP8_EPS = 1e-10  # a group of zeros still gets a non-zero scale
# Bit slot (of eight) of each column of an AWQ word: its order 0,2,4,6,1,3,5,7 inverted
AWQ_SHIFT_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (float8_e4m3fn (M, K), fp32 scales (M, ceil(K/group_size))).

    Each row's groups of group_size columns (the last may be shorter): scale =
    max(|x|, eps) / 448, q = x / scale; x ~= q * scale.
    """
    m, k = x.shape
    groups = -(-k // group_size)
    padded = torch.zeros(m, groups * group_size, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    grouped = padded.view(m, groups, group_size)
    scales = grouped.abs().amax(dim=-1).clamp(min=FP8_EPS) / FP8_MAX
    q = (grouped / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k].contiguous(), scales


def expand_groups(
    scales: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]
) -> torch.Tensor:
    """A (rows/b0, cols/b1) grid of per-block values -> one value per element of ``shape``."""
    rows, cols = shape
    full = scales.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:rows, :cols]


def dequantize_fp8_block(
    weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: tuple[int, int]
) -> torch.Tensor:
    """(N, K) e4m3 with its (ceil(N/bn), ceil(K/bk)) scale grid -> fp32 (N, K)."""
    scale = expand_groups(weight_scale_inv.float(), block_size, (weight.shape[0], weight.shape[1]))
    return weight.float() * scale


def w8a8_block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: tuple[int, int],
) -> torch.Tensor:
    """x (M, K) -> fp32 (M, N): x quantized per token-group of bk, both dequantized, one matmul."""
    x_q, x_s = per_token_group_quant_fp8(x, block_size[1])
    x_dq = x_q.float() * expand_groups(x_s, (1, block_size[1]), (x.shape[0], x.shape[1]))
    return x_dq @ dequantize_fp8_block(weight, weight_scale_inv, block_size).T


def unpack_int4(words: torch.Tensor, dim: int, awq_order: bool = False) -> torch.Tensor:
    """int32 words -> their eight 4-bit values each (0..15), unpacked along ``dim``.

    Value i of a word (position 8j+i along ``dim``) sits at bit 4*i, or at bit
    4*AWQ_SHIFT_SLOT[i] in AWQ's order.
    """
    slots = AWQ_SHIFT_SLOT if awq_order else tuple(range(8))
    shifts = torch.tensor(slots, dtype=torch.int32, device=words.device) * 4
    w = words.unsqueeze(dim + 1 if dim >= 0 else dim)
    view = [1] * w.dim()
    view[dim + 1 if dim >= 0 else dim] = 8
    values = (w >> shifts.view(view)) & 0xF
    shape = list(words.shape)
    shape[dim] *= 8
    return values.reshape(shape)


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """GPTQ 4-bit tensors -> fp32 (K, N), input-major like x @ w."""
    q = unpack_int4(qweight, dim=0)  # (K, N)
    zeros = unpack_int4(qzeros, dim=1) + 1  # (G, N), stored minus one
    k = q.shape[0]
    groups = (
        g_idx.long()
        if g_idx is not None
        else torch.arange(k, device=q.device) // (k // scales.shape[0])
    )
    return ((q - zeros[groups]).to(scales.dtype) * scales[groups]).float()


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """AWQ GEMM-packed 4-bit tensors -> fp32 (K, N)."""
    q = unpack_int4(qweight, dim=1, awq_order=True)  # (K, N)
    zeros = unpack_int4(qzeros, dim=1, awq_order=True)  # (G, N)
    groups = torch.arange(q.shape[0], device=q.device) // (q.shape[0] // scales.shape[0])
    return ((q - zeros[groups]).to(scales.dtype) * scales[groups]).float()


def dequantize_pack_quantized(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """compressed-tensors pack-quantized 4-bit tensors -> fp32 (K, N)."""
    q = unpack_int4(weight_packed, dim=1)  # (N, K), value + 8
    n, k = q.shape
    if weight_zero_point is None:
        zeros = torch.full_like(weight_scale, 8, dtype=torch.int32)
    else:
        zeros = unpack_int4(weight_zero_point, dim=0)[:n]  # (N, G), zero point + 8
    groups = torch.arange(k, device=q.device) // (k // weight_scale.shape[1])
    return ((q - zeros[:, groups]).to(weight_scale.dtype) * weight_scale[:, groups]).float().T


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., N, K/32, 16) uint8 e2m1 pairs and (..., N, K/32) e8m0 -> fp32 (..., N, K)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.long()
    values = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1)  # low nibble first
    values = values.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2)


def dequantize_mxfp4_experts(experts: Mxfp4ExpertWeights) -> ExpertWeights:
    """gpt-oss's MXFP4 experts -> fp32 ``ExpertWeights`` (input-major, gate columns then up)."""
    gate_up = dequantize_mxfp4(experts.gate_up_blocks, experts.gate_up_scales)  # (E, 2I, H)
    gate_first = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1)
    bias = experts.gate_up_bias
    return ExpertWeights(
        w13=gate_first.transpose(1, 2).contiguous(),
        w2=dequantize_mxfp4(experts.down_blocks, experts.down_scales).transpose(1, 2).contiguous(),
        b13=torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1).float() if bias is not None else None,
        b2=experts.down_bias.float() if experts.down_bias is not None else None,
        activation=experts.activation,
    )


def dequantize_fp8_block_expert(
    experts: Fp8BlockExpertWeights,
    e: int,
    dequantize: Callable[
        [torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor
    ] = dequantize_fp8_block,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e -> fp32, output-major: gate_up (2 * inter, hidden), gate rows first, and
    down (hidden, inter); gate and up each dequantized on its own scale grid (by
    ``dequantize``: this module's, or a faster one giving the same values)."""
    inter, rows = experts.gate_up.shape[1] // 2, experts.gate_up_scale_inv.shape[1] // 2
    gate_up, scale = experts.gate_up[e], experts.gate_up_scale_inv[e]
    gate = dequantize(gate_up[:inter], scale[:rows], experts.block)
    up = dequantize(gate_up[inter:], scale[rows:], experts.block)
    down = dequantize(experts.down[e], experts.down_scale_inv[e], experts.block)
    return torch.cat((gate, up)), down


def dequantize_quantized_expert(
    experts: QuantizedExpertWeights, e: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e -> fp32, output-major, as ``dequantize_fp8_block_expert``: gate_up
    (2 * inter, hidden), gate rows first, and down (hidden, inter)."""
    gate, up, down = experts.gate[e], experts.up[e], experts.down[e]
    gate_up = torch.cat((gate.dequantize(0, gate.out_features), up.dequantize(0, up.out_features)))
    return gate_up, down.dequantize(0, down.out_features)


def dequantize_experts(experts: Fp8BlockExpertWeights | QuantizedExpertWeights) -> ExpertWeights:
    """Every expert -> fp32 ``ExpertWeights`` (input-major, gate columns then up)."""
    if isinstance(experts, Fp8BlockExpertWeights):
        pairs = [dequantize_fp8_block_expert(experts, e) for e in range(experts.num_experts)]
    else:
        pairs = [dequantize_quantized_expert(experts, e) for e in range(experts.num_experts)]
    return ExpertWeights(
        w13=torch.stack([gate_up.t() for gate_up, _ in pairs]).contiguous(),
        w2=torch.stack([down.t() for _, down in pairs]).contiguous(),
        activation=experts.activation,
    )
