"""Quantized routed experts on tensor-parallel ranks: each expert is cut inside, as plain
experts are, its shard staying in its format's layout and dequantizing to exactly its slice
of the whole expert; 2 CPU ranks give 1 rank's tokens.

The zoo Qwen3-MoE (layer 1 sparse: 8 experts of hidden 64, inter 32; layers 0 and 2 dense,
MLP 96) cut for 2 ranks: every expert's gate/up outputs and down inputs at 16, the dense
MLPs' at 48 (worker/models/quant/sharding.py's ``experts_shard``). Block FP8 of (16, 16),
on it and on the zoo DeepSeek-V3 (the same experts, MLA and a shared expert around them);
GPTQ with groups of 32 (down's cut at 16 falls inside a group, which its g_idx carries) and
act-order GPTQ with groups of 16 (a rank's 16 inputs read groups shuffled over all 32); AWQ
and compressed-tensors asymmetric W4A16 with groups of 16 (its zero points packed eight
outputs a word); compressed-tensors W8A16 (a scale per output, four values a word).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import Engine
from batchgen.kernels.experts import Fp8BlockExpertWeights, QuantizedExpertWeights
from batchgen.kernels.quant_reference import dequantize_experts
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.quant.awq import AwqWeight
from batchgen.worker.models.quant.compressed_tensors import CompressedWeight
from batchgen.worker.models.quant.gptq import GptqWeight
from batchgen.worker.models.quant.sharding import experts_shard
from batchgen.worker.models.tensor_parallel import build_sharded_model
from batchgen.worker.models.tensor_shard import Shard
from tests.model_zoo import VOCAB
from tests.quant_checkpoints import quantize_awq, quantize_fp8_block, quantize_gptq
from tests.quant_moe_checkpoints import compress_moe
from tests.test_quantized_moe import MOE_PROJECTION
from tests.test_quantized_moe_int import PROJECTIONS, ROUTER_IGNORED
from tests.test_tensor_parallel import SETTINGS, one_and_two_ranks

KINDS = ["fp8-block", "deepseek-fp8-block", "gptq", "gptq-act-order", "awq", "w4a16", "w8a16"]
PART = {"gptq": GptqWeight, "gptq-act-order": GptqWeight, "awq": AwqWeight,
        "w4a16": CompressedWeight, "w8a16": CompressedWeight}  # fmt: skip


def _checkpoint(zoo_model, tmp_path: Path, kind: str) -> Path:
    zoo = "deepseek_v3" if kind.startswith("deepseek") else "qwen3_moe"
    src, out, ref = zoo_model(zoo), tmp_path / kind, tmp_path / f"{kind}-plain"
    if kind.endswith("fp8-block"):
        return quantize_fp8_block(src, out, (16, 16), projections=MOE_PROJECTION)
    if kind.startswith("w"):
        return compress_moe(src, out, "w4a16-asym" if kind == "w4a16" else kind, ROUTER_IGNORED)
    if kind == "awq":
        return quantize_awq(src, out, ref, group=16, projections=PROJECTIONS, skip=("gate",))[0]
    act_order = kind == "gptq-act-order"
    group = 16 if act_order else 32
    return quantize_gptq(src, out, ref, group=group, act_order=act_order,
                         projections=PROJECTIONS)[0]  # fmt: skip


def _experts(layer: Any) -> Fp8BlockExpertWeights | QuantizedExpertWeights:
    mlp = getattr(layer.mlp, "block", layer.mlp)
    return mlp.experts


def _check_layout(experts: Any, kind: str, inter: int) -> None:
    """Still as the checkpoint stores it: FP8 bytes and scale grids, or packed parts."""
    if kind.endswith("fp8-block"):
        assert isinstance(experts, Fp8BlockExpertWeights)
        assert experts.gate_up.dtype == experts.down.dtype == torch.float8_e4m3fn
        assert experts.gate_up.shape == (8, 2 * inter, 64) and experts.down.shape == (8, 64, inter)
        assert experts.gate_up_scale_inv.shape == (8, 2 * inter // 16, 4)
        assert experts.down_scale_inv.shape == (8, 4, inter // 16)
        return
    assert isinstance(experts, QuantizedExpertWeights)
    parts = (*experts.gate, *experts.up, *experts.down)
    assert all(type(p) is PART[kind] for p in parts)
    assert {(p.out_features, p.in_features) for p in (*experts.gate, *experts.up)} == {(inter, 64)}
    assert {(p.out_features, p.in_features) for p in experts.down} == {(64, inter)}


@pytest.mark.parametrize("kind", KINDS)
def test_each_expert_shard_dequantizes_to_its_slice_of_the_whole(zoo_model, tmp_path, kind):
    path = _checkpoint(zoo_model, tmp_path, kind)
    model: Any = Engine.from_pretrained(path, **SETTINGS).runner.model
    whole = _experts(model.weights.layers[1])
    _check_layout(whole, kind, 32)
    plain = dequantize_experts(whole)
    for rank in range(2):
        local = build_sharded_model(path, model.config, torch.device("cpu"), torch.float32,
                                    model.ops, 64, Shard(rank, 2)).weights  # fmt: skip
        mine = _experts(local.layers[1])
        _check_layout(mine, kind, 16)
        assert mine.names == whole.names and mine.names[3][2].endswith("experts.3.down_proj")
        span = torch.arange(16 * rank, 16 * rank + 16)
        got = dequantize_experts(mine)
        assert torch.equal(got.w13, plain.w13[:, :, torch.cat((span, 32 + span))]), (kind, rank)
        assert torch.equal(got.w2, plain.w2[:, span]), (kind, rank)
        if kind == "gptq-act-order":  # each expert's down keeps the groups its inputs read
            for part, full in zip(mine.down, whole.down, strict=True):
                assert isinstance(part, GptqWeight) and isinstance(full, GptqWeight)
                read = full.g_idx[16 * rank : 16 * rank + 16]
                first = int(read.min())
                assert torch.equal(part.g_idx, read - first)
                assert torch.equal(part.scales, full.scales[first : int(read.max()) + 1])
        if kind == "gptq":  # down's 16 inputs: 2 of its 4 words, inside its one group of 32
            down = mine.down[0]
            assert isinstance(down, GptqWeight)
            assert down.qweight.shape == (2, 64) and down.scales.shape == (1, 64)


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_give_one_ranks_tokens(zoo_model, tmp_path, kind):
    path = _checkpoint(zoo_model, tmp_path, kind)
    expected, got = one_and_two_ranks(
        path, VOCAB, lambda weights: _check_layout(_experts(weights.layers[1]), kind, 16)
    )
    assert got == expected


def test_an_fp8_expert_cut_inside_a_block_is_refused_by_module(zoo_model, tmp_path):
    """Experts alone in blocks of 32 (attention and the dense MLPs left plain): their 32
    intermediate features cut at 16."""
    plain = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj")  # fmt: skip
    path = quantize_fp8_block(zoo_model("qwen3_moe"), tmp_path / "fp8", (32, 32), plain,
                              MOE_PROJECTION)  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"would cut model\.layers\.1\.mlp\.experts\."
                       r"0\.gate_proj \(Fp8BlockWeight\) at output features \[0, 16\) of 32, "
                       r"inside its groups of 32; use a tensor_parallel_size"):  # fmt: skip
        Engine.from_pretrained(path, **SETTINGS, tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("kind", "span", "refused"),
    [
        ("gptq", (4, 16), r"experts\.0\.gate_proj \(GptqWeight\) at output features \[4, 16\) "
         r"of 32, inside its int32 words of 8 packed values"),
        ("awq", (0, 8), r"experts\.0\.down_proj \(AwqWeight\) at input features \[0, 8\) of "
         r"32, inside its groups of 16"),
    ],
)  # fmt: skip
def test_an_int_expert_cut_inside_a_word_or_group_is_refused_by_module(
    zoo_model, tmp_path, kind, span, refused
):
    """GPTQ's zero points pack 8 of gate's outputs a word; AWQ's down has groups of 16
    inputs (its gate and up cut at 8 keep whole words)."""
    engine = Engine.from_pretrained(_checkpoint(zoo_model, tmp_path, kind), **SETTINGS)
    experts = _experts(engine.runner.model.weights.layers[1])  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedModelError, match=r"would cut model\.layers\.1\.mlp\." + refused):
        experts_shard(experts, lambda inter: span)


def test_a_gpu_ranks_int_experts_are_dequantized_once_after_the_cut(zoo_model, tmp_path):
    """Off the CPU a rank's GPTQ experts, cut on the CPU, become its slice in the model's
    dtype once, as one GPU's loader makes them (the Triton fused-MoE kernel has no GEMM for
    them, and would dequantize every expert on every call); the step is told a GPU here
    (no GPU on this machine) and run on the CPU-built shard."""
    from batchgen.kernels.experts import ExpertWeights
    from batchgen.worker.models.tensor_parallel import _experts_on_device

    path = _checkpoint(zoo_model, tmp_path, "gptq")
    model: Any = Engine.from_pretrained(path, **SETTINGS).runner.model
    local = build_sharded_model(path, model.config, torch.device("cpu"), torch.float32,
                                model.ops, 64, Shard(1, 2)).weights  # fmt: skip
    cut = dequantize_experts(_experts(local.layers[1]))
    _experts_on_device(local, torch.device("cuda"), torch.bfloat16)
    plain = _experts(local.layers[1])
    assert isinstance(plain, ExpertWeights)
    assert plain.w13.dtype == plain.w2.dtype == torch.bfloat16
    assert torch.equal(plain.w13, cut.w13.to(torch.bfloat16))
    assert torch.equal(plain.w2, cut.w2.to(torch.bfloat16)) and plain.w2.shape == (8, 16, 64)
