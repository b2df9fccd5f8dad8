"""The Triton fused-MoE kernel against the per-expert loop oracle (``moe_reference.py``).

Without CUDA it runs through the Triton interpreter (conftest sets
TRITON_INTERPRET=1 first), so shapes are small; with CUDA the same tests run
compiled.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import moe_reference
from batchgen.kernels import reference as ref

pytest.importorskip("triton")

from batchgen.kernels.triton.fused_moe import sort_by_expert
from batchgen.kernels.triton.op_set import TRITON_OPS
from tests.test_moe_kernels import GPT_OSS, make_experts, make_routing

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (6e-2, 3e-2)}


def _on_device(experts):
    for name in ("w13", "w2", "b13", "b2"):
        t = getattr(experts, name)
        if t is not None:
            setattr(experts, name, t.to(DEVICE))
    return experts


def test_sort_by_expert_lays_each_experts_pairs_out_in_padded_blocks():
    ids = torch.tensor([[2, 0], [0, 2], [2, 3], [0, 2]], device=DEVICE)  # 8 pairs, expert 1 unused
    order = sort_by_expert(ids, num_experts=4, block_m=4)
    pad = 8  # num_pairs: the padding rows' value
    # expert 0: pairs 1, 2, 6 | expert 2: pairs 0, 3, 4, 7 | expert 3: pair 5
    assert order.sorted_pairs.tolist()[:12] == [1, 2, 6, pad, 0, 3, 4, 7, 5, pad, pad, pad]
    assert all(p == pad for p in order.sorted_pairs.tolist()[12:])
    # cdiv(8, 4) + min(8, 4) = 6 blocks allocated, 3 used
    assert order.block_experts.tolist() == [0, 2, 3, 4, 4, 4]


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k", [(1, 4, 2), (9, 4, 2), (20, 8, 3), (3, 16, 6)]
)
def test_fused_moe_matches_the_oracle(num_tokens, num_experts, top_k):
    experts = _on_device(make_experts(num_experts, 32, 24))
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in make_routing(num_tokens, num_experts, top_k))
    out = TRITON_OPS.fused_moe(x, experts, weights, ids)
    expected = moe_reference.fused_moe(x, experts, weights, ids)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_fused_moe_gpt_oss_biases_and_clamped_activation():
    experts = _on_device(make_experts(4, 48, 40, biases=True, activation=GPT_OSS))
    x = (torch.randn(6, 48, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in make_routing(6, 4, 2))
    out = TRITON_OPS.fused_moe(x, experts, weights, ids)
    torch.testing.assert_close(
        out, moe_reference.fused_moe(x, experts, weights, ids), atol=1e-4, rtol=1e-4
    )


def test_fused_moe_with_many_pairs_per_expert_uses_big_blocks():
    # 130 pairs > 32 per expert x 2 experts: block_m 64, several blocks per expert
    experts = _on_device(make_experts(2, 16, 16, seed=5))
    x = torch.randn(130, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in make_routing(130, 2, 1))
    out = TRITON_OPS.fused_moe(x, experts, weights, ids)
    torch.testing.assert_close(
        out, moe_reference.fused_moe(x, experts, weights, ids), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_half_precision(dtype):
    experts = _on_device(make_experts(4, 32, 16, dtype=dtype))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    weights, ids = (t.to(DEVICE) for t in make_routing(5, 4, 2))
    out = TRITON_OPS.fused_moe(x, experts, weights, ids)
    assert out.dtype == dtype
    expected = moe_reference.fused_moe(x, experts, weights, ids).float()
    # three roundings to the half dtype against an fp32 oracle; the interpreter's
    # fp32 -> bf16 casts truncate, all toward zero, so bf16 gets more room
    bound = 3e-2 if dtype == torch.bfloat16 else 1e-2
    assert float((out.float() - expected).norm() / expected.norm()) < bound


def test_fused_moe_empty_batch_and_bad_input():
    experts = _on_device(make_experts(4, 16, 8))
    x = torch.randn(3, 16).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in make_routing(3, 4, 2))
    assert TRITON_OPS.fused_moe(x[:0], experts, weights[:0], ids[:0]).shape == (0, 16)
    with pytest.raises(ValueError, match="topk_ids has 2 rows for 3 tokens"):
        TRITON_OPS.fused_moe(x, experts, weights[:2], ids[:2])
    with pytest.raises(ValueError, match=r"w13 must have shape"):
        TRITON_OPS.fused_moe(x[:, :8], experts, weights, ids)
    with pytest.raises(TypeError, match="topk_ids"):
        TRITON_OPS.fused_moe(x, experts, weights, ids.float())
    with pytest.raises(TypeError, match="dtypes must match"):
        TRITON_OPS.fused_moe(x.half(), experts, weights, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu(dtype):
    from batchgen.kernels.triton.activation import clamped_swiglu

    x = (torch.randn(5, 2 * 70, generator=torch.Generator().manual_seed(8)) * 6).to(DEVICE, dtype)
    atol, rtol = TOL[dtype]
    expected = ref.clamped_swiglu(x.float(), 1.702, 7.0).to(dtype)
    torch.testing.assert_close(clamped_swiglu(x, 1.702, 7.0), expected, atol=atol, rtol=rtol)


@pytest.mark.gpu
def test_gpu_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    """No host sync: captured once, replayed after the routing changed in place."""
    experts = _on_device(make_experts(8, 128, 64, dtype=torch.bfloat16))
    x = torch.randn(16, 128, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = (t.to(DEVICE) for t in make_routing(16, 8, 2, seed=1))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # compile outside the capture
        TRITON_OPS.fused_moe(x, experts, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON_OPS.fused_moe(x, experts, weights, ids)
    new_weights, new_ids = (t.to(DEVICE) for t in make_routing(16, 8, 2, seed=2))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    expected = moe_reference.fused_moe(x, experts, weights, ids).float()
    assert float((out.float() - expected).norm() / expected.norm()) < 1e-2
