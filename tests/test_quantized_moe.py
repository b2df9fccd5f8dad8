"""Block-wise FP8 MoE checkpoints (Qwen3-30B-A3B-FP8, DeepSeek-V3/R1) run with their experts
and MLA projections kept FP8, and give transformers' dequantized tokens.

The checkpoints are tiny random ones written offline in the releases' layout
(``tests/quant_checkpoints.py``): every projection transformers' FP8
integration replaces (attention, dense MLP, each routed and shared expert's
gate/up/down, MLA's q_a/q_b/kv_a_proj_with_mqa/kv_b/o) is ``weight`` e4m3 plus a
``weight_scale_inv`` grid; routers, norms, embeddings and lm_head stay plain
(Qwen3's release lists lm_head and the routers in modules_to_not_convert,
DeepSeek-V3's lists nothing: its router is no nn.Linear). The reference is
transformers in fp32 loading the same files with
``FineGrainedFP8Config(dequantize=True)``.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from batchgen import Engine
from batchgen.kernels import quant_reference as qref
from batchgen.kernels.cpu import routed_experts
from batchgen.kernels.experts import ExpertWeights, Fp8BlockExpertWeights
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.quant import QuantizedLinear
from batchgen.worker.models.weights import Linear
from tests.quant_checkpoints import dequantized, fp8_block, quantize_fp8_block
from tests.test_quantized_models import _check_matches, _model_bytes

# every nn.Linear of a decoder layer: attention (MLA's too), dense MLP, routed and shared experts
MOE_PROJECTION = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.|shared_experts\.)?"
    r"\w+_proj(_with_mqa)?\.weight$"
)


def _fp8_experts(
    num: int, hidden: int, inter: int, block: tuple[int, int]
) -> Fp8BlockExpertWeights:
    torch.manual_seed(0)
    gate_up, gate_up_scale, down, down_scale = [], [], [], []
    for _ in range(num):
        (gq, gs), (uq, us) = (fp8_block(torch.randn(inter, hidden), block) for _ in "gu")
        dq, ds = fp8_block(torch.randn(hidden, inter), block)
        gate_up.append(torch.cat((gq, uq)))
        gate_up_scale.append(torch.cat((gs, us)))
        down.append(dq)
        down_scale.append(ds)
    stack = torch.stack
    return Fp8BlockExpertWeights(
        stack(gate_up), stack(gate_up_scale), stack(down), stack(down_scale), block
    )


U = 2.0**-24  # fp32's unit roundoff


def reassociation_bound(
    x: torch.Tensor, experts: ExpertWeights, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Per output of ``routed_experts.fused_moe`` (silu experts, no biases), how far two fp32
    evaluations of it on the same values may be apart when they add each dot product's
    terms in another order (another GEMM kernel, another split over threads). An n-term
    fp32 dot product is within gamma_n * sum|a_i b_i| of the exact one, gamma_n = n u /
    (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so two orders
    are within twice that of each other. Gate's and up's differences pass through silu
    (|silu'| < 1.1) and their product; down's dot product adds its own; each elementwise
    step (silu, the products, the routing weight and the sum of a token's experts) rounds
    each side within a few u of its value (8 u allowed per side). Computed in fp64."""

    def gamma2(n: int) -> float:
        return 2 * n * U / (1 - n * U)

    x64, w13, w2 = x.double(), experts.w13.double(), experts.w2.double()
    hidden, inter = w13.shape[1], w2.shape[1]
    bound = torch.zeros_like(x64)
    for t, k in itertools.product(range(ids.shape[0]), range(ids.shape[1])):
        e = int(ids[t, k])
        gate_up = x64[t] @ w13[e]
        off = gamma2(hidden) * (x64[t].abs() @ w13[e].abs())
        g, up, dg, du = gate_up[:inter], gate_up[inter:], off[:inter], off[inter:]
        act = torch.nn.functional.silu(g)
        h = act * up
        dh = 1.1 * dg * (up.abs() + du) + act.abs() * du + 16 * U * h.abs()
        y = h @ w2[e]
        dy = dh @ w2[e].abs() + gamma2(inter) * (h.abs() @ w2[e].abs()) + 16 * U * y.abs()
        bound[t] += float(weights[t, k]) * dy
    return bound


@pytest.mark.parametrize("inter", [16, 20])
def test_fp8_experts_product_equals_dequantize_then_run(inter: int) -> None:
    """Whole blocks, and partial ones (inter 20 over blocks of 8 rows): gate and up keep their
    own grids; the CPU product dequantizing one expert at a time (its faster dequantizer
    giving the reference's values exactly) equals running the dequantized experts."""
    experts = _fp8_experts(num=4, hidden=48, inter=inter, block=(8, 16))
    for e in range(4):
        fast = qref.dequantize_fp8_block_expert(experts, e, routed_experts._dequantize_fp8_block)
        for got, want in zip(fast, qref.dequantize_fp8_block_expert(experts, e)):
            assert torch.equal(got, want)
    rows = -(-inter // 8)  # gate's rows of blocks, then up's as many
    assert experts.gate_up_scale_inv.shape == (4, 2 * rows, 3)
    plain = qref.dequantize_experts(experts)
    # the format's definition: up's row 1 is stored row inter + 1, scaled by up's first blocks
    q, scale = experts.gate_up[2], experts.gate_up_scale_inv[2]
    assert plain.w13[2, 40, inter + 1] == q[inter + 1, 40].float() * scale[rows, 40 // 16]
    seeded = torch.Generator().manual_seed(1)
    x = torch.randn(9, 48, generator=seeded)
    ids = torch.tensor([[0, 3], [3, 1], [1, 0], [3, 2], [0, 1], [2, 3], [1, 2], [3, 0], [2, 1]])
    weights = torch.rand(9, 2, generator=seeded)
    got = routed_experts.fused_moe(x, experts, weights, ids)
    want = routed_experts.fused_moe(x, plain, weights, ids)
    # the same fp32 products on both sides (the weights' values are equal, above), added in
    # another order: the FP8 side multiplies by a transposed view (another GEMM kernel), and
    # the thread count splits the sums (OMP_NUM_THREADS=2 moved outputs of ~500 by 1.2e-4
    # here, past the 1e-6 this test once allowed), so the bound is the math's, per output
    bound = reassociation_bound(x, plain, weights, ids)
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())
    # tight enough that a wrong scale block (values off by whole percents) could not pass
    assert float(bound.max()) < 1e-3 * float(want.abs().max())


@pytest.mark.parametrize("inter", [16, 20])
def test_the_triton_op_takes_fp8_experts_as_stored(inter: int) -> None:
    """The Triton fused_moe (under the interpreter) given block-FP8 experts as stored
    dequantizes them inside its GEMMs, up's rows on up's own scale grid where gate's last
    block is partial (inter 20), and equals the dequantized experts' product."""
    pytest.importorskip("triton")
    from batchgen.kernels.triton.op_set import TRITON_OPS

    experts = _fp8_experts(num=4, hidden=48, inter=inter, block=(8, 16))
    x = torch.randn(5, 48)
    ids = torch.tensor([[0, 3], [3, 1], [1, 0], [3, 2], [2, 1]])
    weights = torch.rand(5, 2)
    got = TRITON_OPS.fused_moe(x, experts, weights, ids)
    want = routed_experts.fused_moe(x, qref.dequantize_experts(experts), weights, ids)
    # outputs of ~30: fp32 sums in another order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def _fp8_reference(path: Path) -> Any:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=FineGrainedFP8Config(dequantize=True),
    )  # fmt: skip
    return model.eval()


def _stored_fp8(path: Path, keep: re.Pattern[str]) -> tuple[int, int]:
    """(fp8 weight elements, scale bytes) of the checkpoint's tensors whose names match."""
    tensors = load_file(str(path / "model.safetensors"))
    fp8 = [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn and keep.match(n)]
    scales = sum(tensors[n.removesuffix("weight") + "weight_scale_inv"].nbytes for n in fp8)
    return sum(tensors[n].numel() for n in fp8), scales


@pytest.mark.parametrize(
    ("zoo", "block", "skip"),
    [
        # Qwen3-30B-A3B-FP8's config: lm_head and every router left unconverted
        ("qwen3_moe", (16, 32), ("lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(3)))),
        ("deepseek_v3", (8, 8), ()),  # DeepSeek-V3's: no modules_to_not_convert
    ],
)
def test_fp8_moe_checkpoint(
    zoo_model, tmp_path: Path, zoo: str, block: tuple[int, int], skip: tuple[str, ...]
) -> None:
    path = quantize_fp8_block(zoo_model(zoo), tmp_path / "fp8", block, skip, MOE_PROJECTION)
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    layers = engine.runner.model.weights.layers  # type: ignore[attr-defined]
    moe = layers[1].mlp
    experts = moe.experts
    # kept FP8: the experts as stored (8 of them, gate and up stacked), the router plain
    assert isinstance(experts, Fp8BlockExpertWeights) and experts.block == block
    assert experts.gate_up.dtype == experts.down.dtype == torch.float8_e4m3fn
    assert experts.gate_up.shape == (8, 64, 64) and experts.down.shape == (8, 64, 32)
    assert type(moe.router.gate) is Linear and moe.router.gate.weight.dtype == torch.float32
    attention = layers[0].attention
    if zoo == "deepseek_v3":
        mla = [attention.q_a, attention.q_b, attention.kv_a, attention.o, moe.shared.up]
        assert all(isinstance(p, QuantizedLinear) for p in mla)
        assert attention.w_uk.dtype == torch.float32  # kv_b: dequantized once at load
    else:
        assert isinstance(attention.qkv, QuantizedLinear)

    ties = _check_matches(engine, _fp8_reference(path))
    print(f"{zoo} near ties: {ties or 'none'}")

    # memory: the plain fp32 model less 3 bytes of every weight kept fp8, plus its scales
    # (kv_b_proj, dequantized at load, is plain in both)
    plain = Engine.from_pretrained(dequantized(path, tmp_path / "plain"), num_kv_blocks=64)
    kept, scales = _stored_fp8(path, re.compile(r"(?!.*kv_b_proj)"))
    assert _model_bytes(engine) == _model_bytes(plain) - 3 * kept + scales
    expert_numel = experts.gate_up.numel() + experts.down.numel()
    resident = expert_numel + experts.gate_up_scale_inv.nbytes + experts.down_scale_inv.nbytes
    print(f"{zoo} layer 1 experts: {resident} bytes resident, {2 * expert_numel} in bf16 "
          f"({resident / (2 * expert_numel):.3f}); model {_model_bytes(engine)} bytes, "
          f"{_model_bytes(plain)} plain fp32")  # fmt: skip
    assert resident < 0.55 * 2 * expert_numel  # about half of bf16


def test_mla_rope_rows_across_scale_blocks_refused(zoo_model, tmp_path: Path) -> None:
    """Blocks of 4 rows split a head's 8 interleaved rope rows: reordering them would move
    rows between scales, so the load is refused by name rather than computed wrong."""
    path = quantize_fp8_block(
        zoo_model("deepseek_v3"), tmp_path / "fp8", (4, 8), (), MOE_PROJECTION
    )
    with pytest.raises(UnsupportedModelError, match="rope rows cross its scale blocks"):
        Engine.from_pretrained(path, num_kv_blocks=64)
