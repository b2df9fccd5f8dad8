"""Routed experts on the CPU path against the per-expert loop oracle, the oracle
against a hand computation, and the routers against transformers' own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import moe_reference
from batchgen.kernels import reference as ref
from batchgen.kernels.experts import ClampedSwiGLU, ExpertWeights
from batchgen.kernels.ops import CPU_OPS
from batchgen.kernels.routing import GroupedTopK, softmax_topk, topk_softmax

GPT_OSS = ClampedSwiGLU(alpha=1.702, limit=7.0)


def make_experts(
    num_experts: int,
    hidden: int,
    inter: int,
    *,
    biases: bool = False,
    activation: ClampedSwiGLU | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    return ExpertWeights(
        w13=randn(num_experts, hidden, 2 * inter, std=hidden**-0.5 * 3),
        w2=randn(num_experts, inter, hidden, std=inter**-0.5),
        b13=randn(num_experts, 2 * inter, std=1.0) if biases else None,
        b2=randn(num_experts, hidden, std=0.5) if biases else None,
        activation=activation,
    )


def make_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return softmax_topk(logits, top_k, renormalize=False)


def test_oracle_is_the_weighted_sum_of_each_tokens_experts():
    experts = make_experts(4, 8, 6, biases=True, activation=GPT_OSS)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2)) * 3
    ids = torch.tensor([[0, 3], [2, 0], [1, 1]])  # token 2 routed twice to one expert
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.25], [0.1, 0.2]])
    out = moe_reference.fused_moe(x, experts, weights, ids)
    assert experts.b13 is not None and experts.b2 is not None
    for t in range(3):
        expected = torch.zeros(8)
        for k in range(2):
            e = int(ids[t, k])
            h = ref.clamped_swiglu(x[t : t + 1] @ experts.w13[e] + experts.b13[e], 1.702, 7.0)
            expected += weights[t, k] * (h @ experts.w2[e] + experts.b2[e])[0]
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k", [(1, 8, 2), (7, 4, 2), (33, 8, 3), (5, 16, 8)]
)
@pytest.mark.parametrize("biases", [False, True])
def test_cpu_path_matches_the_oracle(num_tokens, num_experts, top_k, biases):
    activation = GPT_OSS if biases else None
    experts = make_experts(num_experts, 32, 24, biases=biases, activation=activation)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(3))
    weights, ids = make_routing(num_tokens, num_experts, top_k)
    out = CPU_OPS.fused_moe(x, experts, weights, ids)
    torch.testing.assert_close(out, moe_reference.fused_moe(x, experts, weights, ids))


def test_cpu_path_runs_only_the_experts_tokens_were_routed_to():
    experts = make_experts(6, 16, 8)
    unused = [1, 4]
    for e in unused:  # an expert that ran would turn these into NaN
        experts.w13[e].fill_(float("nan"))
    x = torch.randn(5, 16)
    ids = torch.tensor([[0, 2], [3, 5], [0, 5], [2, 3], [5, 0]])
    weights = torch.rand(5, 2)
    out = CPU_OPS.fused_moe(x, experts, weights, ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, moe_reference.fused_moe(x, experts, weights, ids))


def test_cpu_path_in_bfloat16_and_with_no_tokens():
    experts = make_experts(4, 32, 16, dtype=torch.bfloat16)
    x = torch.randn(6, 32).to(torch.bfloat16)
    weights, ids = make_routing(6, 4, 2)
    out = CPU_OPS.fused_moe(x, experts, weights, ids)
    assert out.dtype == torch.bfloat16
    expected = moe_reference.fused_moe(x, experts, weights, ids).float()
    # the intermediate is rounded to bf16 (a few ulp of O(10) values), the oracle stays fp32
    assert float((out.float() - expected).norm() / expected.norm()) < 1e-2
    empty = CPU_OPS.fused_moe(x[:0], experts, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


def test_clamped_swiglu_clamps_gate_above_and_up_both_sides():
    x = torch.tensor([[10.0, -1.0, 20.0, -20.0]])  # gate (10, -1), up (20, -20)
    out = ref.clamped_swiglu(x, alpha=1.702, limit=7.0)
    gate = torch.tensor([7.0, -1.0])
    up = torch.tensor([7.0, -7.0])
    torch.testing.assert_close(out[0], (up + 1) * gate * torch.sigmoid(1.702 * gate))


# --------------------------------------------------------------------------- routers


def _hf_router(cls, config, seed: int = 4):
    router = cls(config)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        for name, b in router.named_buffers():
            if "correction" in name:  # V3's bias: big enough to change choices
                b.copy_(torch.rand(b.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return router


def _hidden(num_tokens: int = 40, hidden: int = 16) -> torch.Tensor:
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_softmax_topk_matches_mixtral_and_qwen_moe_routers(norm_topk_prob):
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    x = _hidden()
    if norm_topk_prob:  # Mixtral always renormalises
        router = _hf_router(
            MixtralTopKRouter,
            MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2),
        )
    else:
        config = Qwen2MoeConfig(
            hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False
        )
        router = _hf_router(Qwen2MoeTopKRouter, config)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = softmax_topk(logits, router.top_k, renormalize=norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)


def test_topk_softmax_matches_the_gpt_oss_router():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = GptOssConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=4)
    router = _hf_router(GptOssTopKRouter, config)
    logits, hf_weights, hf_ids = router(_hidden())
    weights, ids = topk_softmax(logits, 4)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_grouped_topk_matches_the_deepseek_v2_router(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
        topk_group=2,
        topk_method=method, routed_scaling_factor=1.5,
    )  # fmt: skip
    router = _hf_router(DeepseekV2TopkRouter, config)
    logits, hf_weights, hf_ids = router(_hidden())
    groups = 4 if method == "group_limited_greedy" else 1
    route = GroupedTopK(3, groups, 2, sigmoid=False, renormalize=False, scaling_factor=1.5)
    weights, ids = route(logits)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)


def test_grouped_topk_matches_the_deepseek_v3_router_with_its_correction_bias():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = _hf_router(DeepseekV3TopkRouter, config)
    logits, hf_weights, hf_ids = router(_hidden())
    route = GroupedTopK(4, 4, 2, sigmoid=True, renormalize=True, scaling_factor=2.5)
    weights, ids = route(logits, router.e_score_correction_bias)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    # the bias changes the choice: without it some token picks other experts
    _, unbiased = route(logits)
    assert not torch.equal(unbiased.sort(dim=1).values, ids.sort(dim=1).values)
    # only experts of two groups (of 4 experts each) are chosen per token
    assert all(len({int(e) // 4 for e in row}) <= 2 for row in ids)


def test_grouped_topk_v3_weights_exclude_the_bias():
    logits = torch.tensor([[0.0, 0.0, 2.0, -2.0]])
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0])  # picks expert 0 despite its lower score
    route = GroupedTopK(1, 1, 1, sigmoid=True, renormalize=False, scaling_factor=1.0)
    weights, ids = route(logits, bias)
    assert ids.tolist() == [[0]]
    torch.testing.assert_close(weights, torch.tensor([[0.5]]))
    assert F.sigmoid(torch.tensor(0.0)) == 0.5
