"""MXFP4 experts (gpt-oss's on-disk ``*_blocks``/``*_scales``) inside the Triton fused-MoE kernel,
against dequantize-then-the per-expert loop oracle (``moe_reference.py``).

Without CUDA it runs through the Triton interpreter, so shapes are small.
Tolerances (atol, rtol) are the dense fused-MoE test's: the dequantized
weights are exact in any float dtype (an e2m1 value times a power of two), so
only the kernel's intermediates in x's dtype differ from the fp32 oracle.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import moe_reference
from batchgen.kernels import quant_reference as qref
from batchgen.kernels.experts import Mxfp4ExpertWeights

pytest.importorskip("triton")

from batchgen.kernels.ops import CPU_OPS
from batchgen.kernels.triton.op_set import TRITON_OPS
from tests.test_moe_kernels import GPT_OSS, make_routing

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (6e-2, 3e-2)}


def mxfp4_experts(num_experts: int, hidden: int, inter: int, *, biases: bool, seed: int = 0):
    """Random experts laid out as gpt-oss's checkpoint stores them."""
    gen = torch.Generator().manual_seed(seed)

    def blocks(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.randint(0, 256, (num_experts, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        s = torch.randint(121, 126, (num_experts, n, k // 32), generator=gen, dtype=torch.uint8)
        return b.to(DEVICE), s.to(DEVICE)

    gate_up, gate_up_s = blocks(2 * inter, hidden)
    down, down_s = blocks(hidden, inter)
    bias = lambda *shape: (torch.randn(*shape, generator=gen) * 0.1).to(DEVICE)  # noqa: E731
    return Mxfp4ExpertWeights(
        gate_up, gate_up_s, down, down_s,
        gate_up_bias=bias(num_experts, 2 * inter) if biases else None,
        down_bias=bias(num_experts, hidden) if biases else None,
        activation=GPT_OSS if biases else None,
    )  # fmt: skip


def test_dequantize_mxfp4_reads_e2m1_pairs_low_nibble_first_times_e8m0():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F  # low nibble 0xF = -6.0, high nibble 0x2 = +1.0
    blocks[0, 0, 15] = 0x91  # low 0x1 = +0.5, high 0x9 = -0.5
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    w = qref.dequantize_mxfp4(blocks, scales)
    assert w.shape == (1, 32)
    assert w[0, :2].tolist() == [-12.0, 2.0] and w[0, 30:].tolist() == [1.0, -1.0]
    assert w[0, 2:30].abs().sum().item() == 0


def test_dequantize_mxfp4_equals_transformers_own_for_gpt_oss():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (2, 6, 3), generator=gen, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, K, N)
    assert torch.equal(qref.dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))


def test_gpt_oss_gate_up_rows_interleave_gate_and_up():
    experts = mxfp4_experts(2, 32, 32, biases=True)
    dense = qref.dequantize_mxfp4_experts(experts)
    stored = qref.dequantize_mxfp4(experts.gate_up_blocks, experts.gate_up_scales)
    assert torch.equal(dense.w13[1, :, :32], stored[1, 0::2].T)  # gate: even rows
    assert torch.equal(dense.w13[1, :, 32:], stored[1, 1::2].T)  # up: odd rows
    assert experts.gate_up_bias is not None and dense.b13 is not None
    assert torch.equal(dense.b13[0, 32:], experts.gate_up_bias[0, 1::2].float())


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,hidden,inter,biases,dtype",
    [
        (5, 4, 2, 64, 32, True, torch.float32),  # gpt-oss: biases, clamped SwiGLU
        (3, 4, 2, 32, 64, False, torch.float32),  # SiLU, no biases
        (9, 8, 4, 64, 64, True, torch.bfloat16),
    ],
)
def test_mxfp4_fused_moe_matches_dequantize_then_the_oracle(
    num_tokens, num_experts, top_k, hidden, inter, biases, dtype
):
    experts = mxfp4_experts(num_experts, hidden, inter, biases=biases, seed=num_tokens)
    if biases:
        experts.gate_up_bias = experts.gate_up_bias.to(dtype)
        experts.down_bias = experts.down_bias.to(dtype)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in make_routing(num_tokens, num_experts, top_k))
    out = TRITON_OPS.fused_moe(x, experts, weights.to(dtype), ids)
    expected = moe_reference.fused_moe(x, qref.dequantize_mxfp4_experts(experts), weights, ids)
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("biases", [False, True])
def test_the_cpu_ops_run_mxfp4_experts_as_their_dequantized_weights(biases):
    # the CPU op takes what the Triton op takes (same signature): it dequantizes first
    experts = mxfp4_experts(4, 64, 32, biases=biases, seed=3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in make_routing(6, 4, 2))
    out = CPU_OPS.fused_moe(x, experts, weights, ids)
    expected = moe_reference.fused_moe(x, qref.dequantize_mxfp4_experts(experts), weights, ids)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_mxfp4_experts_of_the_wrong_shape_are_a_clear_error():
    experts = mxfp4_experts(2, 32, 32, biases=False)
    x = torch.randn(1, 64).to(DEVICE)  # hidden 64, the blocks hold 32
    ids = torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"gate_up_blocks must have shape \(2, 64, 2, 16\)"):
        TRITON_OPS.fused_moe(x, experts, torch.ones(1, 1, device=DEVICE), ids)
