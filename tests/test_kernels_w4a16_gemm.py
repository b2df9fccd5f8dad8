"""The W4A16 GEMM on GPTQ, AWQ and compressed-tensors tensors against dequantize-then-matmul in fp32.

Each format's tensors are packed here from random 4-bit values by the
format's definition (the packers below are the libraries' loops: AutoGPTQ's
pack, AutoAWQ's WQLinear_GEMM.from_linear, compressed-tensors' pack_to_int32),
and the dequantizers of ``quant_reference.py`` are themselves checked
against those values, so a layout read wrong on both sides cannot pass.

Tolerance: the kernel rounds the dequantized weight to x's dtype before the
product and its output to x's dtype, fp32 accumulation in between:
|out - ref| <= r (|x| @ |w|) with r = 2^-7 for bf16 (two roundings of 2^-9,
and the interpreter's bf16 cast truncates: 2^-8 each), 2^-10 for fp16,
2^-20 for fp32.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import quant_reference as qref

pytest.importorskip("triton")

from batchgen.kernels.triton.w4a16_gemm import awq_linear, gptq_linear, pack_quantized_linear

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}


def pack_rows(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """(R, C) ints in 0..15 -> int32 (R, C/8): word j's bit 4*i holds column 8j + order[i]."""
    r, c = values.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        words |= values[:, col::8].long() << (4 * i)
    return words.to(torch.int32)  # wraps past 2^31 as the checkpoints' int32 does


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def random_quant(k: int, n: int, groups: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (groups, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.02 + 0.001
    return q, zeros, scales


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.float() @ w
    err = (out.float() - ref).abs()
    bound = REL[x.dtype] * (x.float().abs() @ w.abs())
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def gptq_tensors(k: int, n: int, group: int, act_order: bool, seed: int = 0):
    groups = k // group
    q, zeros, scales = random_quant(k, n, groups, seed)
    zeros = zeros.clamp(max=14)  # the zero minus one must fit 4 bits with the zero <= 15
    g_idx = torch.arange(k) // group
    if act_order:  # rows visited in a permuted order: groups interleave
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))]
    qweight = pack_rows(q.T.contiguous()).T.contiguous()  # packed along K
    qzeros = pack_rows(zeros)  # what the checkpoint stores: the zero minus one
    zeros = zeros + 1
    w = ((q - zeros[g_idx]).half() * scales.half()[g_idx]).float()  # in the scales' fp16
    return qweight, qzeros, scales.half(), (g_idx.int() if act_order else None), w


@pytest.mark.parametrize(
    "m,k,n,group,act_order,dtype",
    [
        (3, 128, 64, 32, False, torch.float16),
        (5, 256, 40, 64, True, torch.bfloat16),  # act-order; N not a multiple of the tile
        (2, 96, 16, 96, False, torch.float32),  # one group
        (3, 192, 16, 96, False, torch.bfloat16),  # 64-row steps cross groups: per-row scales
        (33, 64, 24, 16, True, torch.float32),
    ],
)
def test_gptq(m, k, n, group, act_order, dtype):
    qweight, qzeros, scales, g_idx, w = gptq_tensors(k, n, group, act_order, seed=m)
    assert qweight.shape == (k // 8, n) and qzeros.shape == (k // group, n // 8)
    assert torch.equal(qref.dequantize_gptq(qweight, qzeros, scales, g_idx), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out = gptq_linear(
        x.to(DEVICE), qweight.to(DEVICE), qzeros.to(DEVICE), scales.to(DEVICE),
        g_idx.to(DEVICE) if g_idx is not None else None,
    )  # fmt: skip
    check(out.cpu(), x, w)


@pytest.mark.parametrize(
    "m,k,n,group,dtype",
    [
        (4, 128, 64, 32, torch.float16),
        (1, 64, 48, 64, torch.bfloat16),
        (17, 96, 24, 32, torch.float32),
    ],
)
def test_awq(m, k, n, group, dtype):
    q, zeros, scales = random_quant(k, n, k // group, seed=m)
    qweight, qzeros = pack_rows(q, AWQ_PACK_ORDER), pack_rows(zeros, AWQ_PACK_ORDER)
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8)
    groups = torch.arange(k) // group
    w = ((q - zeros[groups]).half() * scales.half()[groups]).float()
    assert torch.equal(qref.dequantize_awq(qweight, qzeros, scales.half()), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out = awq_linear(x.to(DEVICE), qweight.to(DEVICE), qzeros.to(DEVICE), scales.half().to(DEVICE))
    check(out.cpu(), x, w)


@pytest.mark.parametrize(
    "m,k,n,group,symmetric,dtype",
    [
        (3, 128, 64, 32, True, torch.bfloat16),
        (6, 64, 20, 16, False, torch.float16),
        (2, 64, 32, 64, False, torch.float32),
    ],
)
def test_compressed_tensors_pack_quantized(m, k, n, group, symmetric, dtype):
    gen = torch.Generator().manual_seed(m)
    signed = torch.randint(
        -8, 8, (n, k), generator=gen
    )  # int4 values as compressed-tensors keeps them
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(
        dtype if dtype != torch.float32 else torch.bfloat16
    )
    zero = (
        torch.zeros(n, k // group, dtype=torch.long)
        if symmetric
        else torch.randint(-8, 8, (n, k // group), generator=gen)
    )
    weight_packed = pack_rows(signed + 8)  # (N, K/8), offset 8
    zp = None
    if not symmetric:
        padded = torch.zeros(-(-n // 8) * 8, k // group, dtype=torch.long)
        padded[:n] = zero + 8
        zp = pack_rows(padded.T.contiguous()).T.contiguous()  # packed along N: (ceil(N/8), G)
    groups = torch.arange(k) // group
    w = ((signed - zero[:, groups]).to(scales.dtype) * scales[:, groups]).float().T
    assert torch.equal(qref.dequantize_pack_quantized(weight_packed, scales, zp), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out = pack_quantized_linear(
        x.to(DEVICE),
        weight_packed.to(DEVICE),
        scales.to(DEVICE),
        zp.to(DEVICE) if zp is not None else None,
    )
    check(out.cpu(), x, w)


def test_a_mismatched_tensor_is_a_clear_error():
    qweight, qzeros, scales, _, _ = gptq_tensors(64, 16, 32, False)
    x = torch.randn(2, 64).half()
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 16\)"):
        gptq_linear(x.to(DEVICE), qweight.to(DEVICE), qzeros.to(DEVICE), scales[:, :8].to(DEVICE))
    with pytest.raises(ValueError, match="x has 32 features, the weight takes 64"):
        gptq_linear(x[:, :32].to(DEVICE), qweight.to(DEVICE), qzeros.to(DEVICE), scales.to(DEVICE))
