"""Quantized checkpoints on tensor-parallel ranks: each shard stays in its format's layout,
dequantizes to exactly its slice of the whole weight, and 2 CPU ranks give 1 rank's tokens.

The zoo Llama (hidden 64: 4 heads, 2 KV heads of 16; MLP 128) cut for 2 ranks: q/k/v's
outputs at 32 and 16, o's inputs at 32, gate/up's outputs and down's inputs at 64
(worker/models/quant/sharding.py cuts them). GPTQ with groups of 64 cuts o inside a group,
which its g_idx carries; act-order GPTQ shuffles every projection's groups over its inputs.
Quantized routed experts: tests/test_tensor_parallel_quant_moe.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import Engine
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.quant.awq import AwqWeight
from batchgen.worker.models.quant.gptq import GptqWeight
from batchgen.worker.models.quant.linear import QuantizedLinear
from batchgen.worker.models.quant.sharding import column_shard, row_shard
from batchgen.worker.models.tensor_parallel import build_sharded_model
from batchgen.worker.models.tensor_shard import Shard
from tests.model_zoo import VOCAB
from tests.quant_checkpoints import compress, quantize_awq, quantize_fp8_block, quantize_gptq
from tests.test_tensor_parallel import SETTINGS, _same_or_tie, one_and_two_ranks

KINDS = ["gptq", "gptq-act-order", "gptq-g64", "awq"]


def _checkpoint(zoo_model, tmp_path: Path, kind: str) -> Path:
    src, out, ref = zoo_model("llama"), tmp_path / kind, tmp_path / f"{kind}-plain"
    if kind.startswith("awq"):
        return quantize_awq(src, out, ref, group=64 if kind == "awq-g64" else 32)[0]
    group = 64 if kind == "gptq-g64" else 32
    return quantize_gptq(src, out, ref, group=group, act_order=kind == "gptq-act-order")[0]


def _projections(layer: Any) -> dict[str, QuantizedLinear]:
    attention, mlp = layer.attention, layer.mlp
    attention, mlp = getattr(attention, "block", attention), getattr(mlp, "block", mlp)
    return {"qkv": attention.qkv, "o": attention.o, "up": mlp.up, "down": mlp.down}


def _span(start: int, width: int, rank: int) -> torch.Tensor:
    return torch.arange(start + rank * width, start + (rank + 1) * width)


@pytest.mark.parametrize("kind", KINDS)
def test_each_shard_dequantizes_to_its_slice_of_the_whole(zoo_model, tmp_path, kind):
    path = _checkpoint(zoo_model, tmp_path, kind)
    model: Any = Engine.from_pretrained(path, **SETTINGS).runner.model
    for rank in range(2):  # each rank's model as it builds it, its layers cut as they are read
        local = build_sharded_model(path, model.config, torch.device("cpu"), torch.float32,
                                    model.ops, 64, Shard(rank, 2)).weights  # fmt: skip
        for whole_layer, layer in zip(model.weights.layers, local.layers, strict=True):
            whole, mine = _projections(whole_layer), _projections(layer)
            columns = {
                "qkv": torch.cat((_span(0, 32, rank), _span(64, 16, rank), _span(96, 16, rank))),
                "up": torch.cat((_span(0, 64, rank), _span(128, 64, rank))),
            }
            rows = {"o": _span(0, 32, rank), "down": _span(0, 64, rank)}
            for name, linear in mine.items():
                assert isinstance(linear, QuantizedLinear)
                assert all(isinstance(p, (GptqWeight, AwqWeight)) for p in linear.parts)
                full = whole[name].dequantized()
                expected = full[:, columns[name]] if name in columns else full[rows[name]]
                assert torch.equal(linear.dequantized(), expected), (kind, rank, name)
        o: Any = _projections(local.layers[0])["o"].parts[0]
        if kind == "gptq-act-order":  # the shard's 32 inputs read both groups of 32
            assert o.scales.shape == (2, 64) and sorted(set(o.g_idx.tolist())) == [0, 1]
        elif kind == "gptq-g64":  # o's inputs 0-31 and 32-63 are both in group 0 of 64
            assert o.scales.shape == (1, 64) and int(o.g_idx.max()) == 0
        elif kind == "gptq":
            assert o.scales.shape == (1, 64) and o.qweight.shape == (4, 64)


def test_on_the_triton_ops_each_shard_joins_its_runs_of_a_fused_projection(zoo_model, tmp_path):
    """On the Triton ops q/k/v and gate/up are each one part joined from their modules
    (worker/models/quant/fused_parts.py); a rank cuts its run of each module from it and
    joins the runs again: one part and one GEMM, the CPU path's shard bit for bit."""
    from batchgen.kernels.triton.op_set import TRITON_OPS

    path = _checkpoint(zoo_model, tmp_path, "gptq")
    model: Any = Engine.from_pretrained(path, **SETTINGS).runner.model
    for rank in range(2):
        apart, joined = (
            build_sharded_model(path, model.config, torch.device("cpu"), torch.float32, ops, 64,
                                Shard(rank, 2)).weights
            for ops in (model.ops, TRITON_OPS)
        )  # fmt: skip
        for cpu_layer, layer in zip(apart.layers, joined.layers, strict=True):
            cpu = _projections(cpu_layer)
            assert [len(p.parts) for p in cpu.values()] == [3, 1, 2, 1]
            for name, linear in _projections(layer).items():
                assert len(linear.parts) == 1 and len(linear.kernels or ()) == 1
                assert torch.equal(linear.dequantized(), cpu[name].dequantized()), (rank, name)


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_give_one_ranks_tokens(zoo_model, tmp_path, kind):
    path = _checkpoint(zoo_model, tmp_path, kind)
    shapes = {}

    def look(weights) -> None:
        shapes.update({k: [(p.out_features, p.in_features) for p in v.parts]
                       for k, v in _projections(weights.layers[0]).items()})  # fmt: skip

    expected, got = one_and_two_ranks(path, VOCAB, look)
    assert shapes == {"qkv": [(32, 64), (16, 64), (16, 64)], "o": [(64, 32)],
                      "up": [(64, 64), (64, 64)], "down": [(64, 64)]}  # fmt: skip
    assert got == expected


def test_an_awq_cut_inside_a_group_is_refused_by_module(zoo_model, tmp_path):
    path = _checkpoint(zoo_model, tmp_path, "awq-g64")
    with pytest.raises(UnsupportedModelError, match=r"would cut model\.layers\.0\.self_attn\."
                       r"o_proj \(AwqWeight\) at input features \[0, 32\) of 64, inside its "
                       r"groups of 64; use a tensor_parallel_size"):  # fmt: skip
        Engine.from_pretrained(path, **SETTINGS, tensor_parallel_size=2)


def test_a_gptq_cut_inside_a_packed_word_is_refused_by_module(zoo_model, tmp_path):
    engine = Engine.from_pretrained(_checkpoint(zoo_model, tmp_path, "gptq"), **SETTINGS)
    o = _projections(engine.runner.model.weights.layers[1])["o"]  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedModelError, match=r"cut model\.layers\.1\.self_attn\.o_proj "
                       r"\(GptqWeight\) at input features \[0, 36\) of 64, inside its int32 "
                       r"words of 8 packed values"):  # fmt: skip
        row_shard(o, 0, 36, keep_bias=True)
    qkv = _projections(engine.runner.model.weights.layers[0])["qkv"]  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedModelError, match=r"cut model\.layers\.0\.self_attn\.k_proj "
                       r"\(GptqWeight\) at output features \[4, 32\) of 32"):  # fmt: skip
        column_shard(qkv, torch.arange(68, 96))


@pytest.mark.parametrize("kind", ["fp8-block", "w4a16"])
def test_fp8_and_compressed_weights_split_on_their_groups(zoo_model, tmp_path, kind):
    """Every cut on FP8 blocks of (16, 32) or compressed-tensors' W4A16 groups of 32."""
    src, out = zoo_model("llama"), tmp_path / kind
    path = (
        quantize_fp8_block(src, out, (16, 32))
        if kind == "fp8-block"
        else compress(src, out, "w4a16")
    )

    def look(weights) -> None:
        qkv, down = weights.layers[0].attention.block.qkv, weights.layers[0].mlp.block.down
        assert isinstance(qkv, QuantizedLinear) and isinstance(down, QuantizedLinear)
        assert [(p.out_features, p.in_features) for p in qkv.parts] == [
            (32, 64),
            (16, 64),
            (16, 64),
        ]
        assert [(p.out_features, p.in_features) for p in down.parts] == [(64, 64)]

    expected, got = one_and_two_ranks(path, VOCAB, look)
    _same_or_tie(path, VOCAB, expected, got)


def test_an_fp8_cut_inside_a_block_is_refused_by_module(zoo_model, tmp_path):
    path = quantize_fp8_block(zoo_model("llama"), tmp_path / "fp8", (32, 32))
    with pytest.raises(UnsupportedModelError, match=r"cut model\.layers\.0\.self_attn\.k_proj "
                       r"\(Fp8BlockWeight\) at output features \[0, 16\) of 32, inside its "
                       r"groups of 32"):  # fmt: skip
        Engine.from_pretrained(path, **SETTINGS, tensor_parallel_size=2)


def test_a_format_the_split_does_not_cut_is_refused_by_name(zoo_model, tmp_path):
    from tests.mxfp4_checkpoints import quantize_mxfp4

    path = quantize_mxfp4(zoo_model("gpt_oss"), tmp_path / "mxfp4")
    with pytest.raises(UnsupportedModelError, match="mxfp4-quantized; tensor parallelism splits "
                       "fp8, compressed-tensors, gptq, awq weights only"):  # fmt: skip
        Engine.from_pretrained(path, **SETTINGS, tensor_parallel_size=2)
