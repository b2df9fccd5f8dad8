"""The block-scaled FP8 GEMM and its activation quantizer against dequantize-then-matmul in fp32.

Without CUDA they run through the Triton interpreter (conftest sets
TRITON_INTERPRET=1 first), so shapes are small; block sizes that do not divide
N or K are the point of several cases.

Tolerances: the quantizer must be bit-exact (same scales, same e4m3 bytes).
The GEMM's fp32 result differs from the reference's only in summation order,
so the bound is one ulp of x's dtype (the interpreter's fp32 -> bf16 cast
truncates) plus fp32 reordering:
|out - ref| <= 2^-7 |ref| (bf16; 2^-10 fp16, 2^-20 fp32) + 2^-20 (|x_dq| @ |w_dq|).
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import quant_reference as qref

pytest.importorskip("triton")

from batchgen.kernels.triton.fp8_gemm import per_token_group_quant_fp8, w8a8_block_fp8_linear

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OUT_REL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}


def fp8_checkpoint_weight(n: int, k: int, block: tuple[int, int], seed: int = 0):
    """A linear weight stored as DeepSeek-V3's quantizer stores it: e4m3 blocks, scale_inv grid."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    grid = (-(-n // block[0]), -(-k // block[1]))
    scale_inv = torch.empty(grid)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            rows, cols = (
                slice(i * block[0], (i + 1) * block[0]),
                slice(j * block[1], (j + 1) * block[1]),
            )
            s = w[rows, cols].abs().amax().clamp(min=1e-12) / qref.FP8_MAX
            scale_inv[i, j] = s
            q[rows, cols] = (w[rows, cols] / s).to(torch.float8_e4m3fn)
    return q.to(DEVICE), scale_inv.to(DEVICE)


@pytest.mark.parametrize("k,group", [(256, 128), (300, 128), (40, 16), (7, 16)])
def test_activation_quantizer_is_bit_exact(k, group):
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=gen) * 3).to(torch.bfloat16)
    x[1] = 0  # an all-zero row: scale eps / 448, zeros stay zeros
    x[2, : min(group, k)] *= 1000  # one loud group beside quiet ones
    x = x.to(DEVICE)
    q, s = per_token_group_quant_fp8(x, group)
    q_ref, s_ref = qref.per_token_group_quant_fp8(x, group)
    assert s.shape == (5, -(-k // group))
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s[1].eq(qref.FP8_EPS / qref.FP8_MAX).all()
    # a group's largest value lands on the e4m3 maximum
    assert q[2, : min(group, k)].float().abs().max().item() == qref.FP8_MAX


def test_a_quotient_past_448_lands_on_448_without_a_clamp():
    """The quantizer casts x / scale with no clamp to +-448 (kernels/triton/fp8_gemm.py says
    why none is needed): where the fp32 scale amax / 448 rounds down, the largest value
    over it comes out past 448, and rounds to e4m3's 448 (the boundary to 480 is 464),
    bit for bit as the reference, which clamps first."""
    c = torch.linspace(1.0, 2.0, 4097)
    past = c[c / (c / qref.FP8_MAX) > qref.FP8_MAX][:8]  # fp32 division, as both compute it
    assert past.numel() == 8
    x = torch.rand(8, 16, generator=torch.Generator().manual_seed(3)) * 1.8 - 0.9  # |x| < 1
    x[:, 5] = past * torch.tensor([1.0, -1.0]).repeat(4)  # each row's largest, signs mixed
    q, s = per_token_group_quant_fp8(x.to(DEVICE), 16)
    q_ref, s_ref = qref.per_token_group_quant_fp8(x, 16)
    assert (x[:, 5].abs() / s_ref[:, 0] > qref.FP8_MAX).all()  # past 448 before the cast
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert q[:, 5].float().cpu().tolist() == [448.0, -448.0] * 4


@pytest.mark.parametrize(
    "m,n,k,block,dtype",
    [
        (3, 256, 256, (128, 128), torch.bfloat16),  # DeepSeek-V3's blocks, dividing
        (5, 200, 300, (128, 128), torch.bfloat16),  # last row and column blocks short
        (17, 72, 96, (32, 64), torch.float16),
        (2, 40, 48, (24, 16), torch.float32),  # bn not a power of two, 3 K blocks
        (1, 130, 129, (128, 128), torch.bfloat16),  # one row, K one past a block
    ],
)
def test_block_fp8_gemm_matches_dequantize_then_matmul(m, n, k, block, dtype):
    weight, scale_inv = fp8_checkpoint_weight(n, k, block, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)
    out = w8a8_block_fp8_linear(x, weight, scale_inv, block)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = qref.w8a8_block_fp8_linear(x, weight, scale_inv, block)
    x_q, x_s = qref.per_token_group_quant_fp8(x, block[1])
    x_dq = x_q.float() * qref.expand_groups(x_s, (1, block[1]), (m, k))
    magnitude = x_dq.abs() @ qref.dequantize_fp8_block(weight, scale_inv, block).abs().T
    err = (out.float() - ref).abs()
    bound = OUT_REL[dtype] * ref.abs() + 2.0**-20 * magnitude
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def test_leading_dims_are_kept_and_a_wrong_grid_is_refused():
    weight, scale_inv = fp8_checkpoint_weight(64, 64, (32, 32))
    x = torch.randn(2, 3, 64).to(torch.bfloat16).to(DEVICE)
    assert w8a8_block_fp8_linear(x, weight, scale_inv, (32, 32)).shape == (2, 3, 64)
    with pytest.raises(ValueError, match=r"weight_scale_inv must have shape \(2, 2\)"):
        w8a8_block_fp8_linear(x, weight, scale_inv[:, :1].contiguous(), (32, 32))
    with pytest.raises(ValueError, match="power of two"):
        w8a8_block_fp8_linear(x, weight, scale_inv, (32, 24))
