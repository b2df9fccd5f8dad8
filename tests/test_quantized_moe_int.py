"""GPTQ, AWQ and compressed-tensors MoE checkpoints (Qwen3-30B-A3B-GPTQ-Int4, -AWQ, RedHatAI's
W4A16 MoE) run with their routed experts kept in the checkpoint's packed integers, and give
the dequantized model's tokens.

Tiny random Qwen3-MoE checkpoints (zoo ``qwen3_moe``: layer 1 sparse, 8 experts of
hidden 64, inter 32; layers 0 and 2 dense) written offline in each format's
on-disk layout, each expert's projections named as the releases name them
(``model.layers.1.mlp.experts.3.gate_proj.weight_packed``, ``.qweight``...):

- compressed-tensors W4A16 / W8A16, written by the compressed-tensors library
  (``tests/quant_moe_checkpoints.py``), the router left plain by the ignore list as
  llm-compressor's MoE recipes leave it. Reference: transformers in fp32 with
  ``CompressedTensorsConfig(dequantize=True)``, which decompresses each expert with the
  library and fuses them (and whose expert weights equal batchgen's dequantized ones
  exactly, checked).
- GPTQ (v1, act-order) and AWQ GEMM: no GPTQ/AWQ library installs here, so transformers
  cannot load them; the reference is the format's definition in plain torch
  (``tests/quant_checkpoints.py``: each weight ``(q - zero) * scale`` in fp16) written as a
  plain checkpoint and run by transformers in fp32.

Greedy tokens of 4 prompts equal the reference's and teacher-forced logits are within
2e-4 (``_check_matches``); a first difference is allowed only at a reference top-2 gap
of at most 2e-3, printed (near ties).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from batchgen import Engine
from batchgen.kernels.experts import QuantizedExpertWeights
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.quant import QuantizedLinear
from batchgen.worker.models.quant.awq import AwqWeight
from batchgen.worker.models.quant.compressed_tensors import CompressedWeight
from batchgen.worker.models.quant.gptq import GptqWeight
from batchgen.worker.models.weights import Linear
from tests.quant_checkpoints import quantize_awq, quantize_gptq
from tests.quant_moe_checkpoints import compress_moe, moe_reference
from tests.test_quantized_models import _check_matches

# the releases' quantized projections: attention, dense MLP, each routed expert's (not the router)
PROJECTIONS = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?\w+_proj\.weight$")
ROUTER_IGNORED = ("lm_head", "re:.*mlp.gate$")  # RedHatAI's MoE releases' ignore list


def _experts(engine: Engine) -> QuantizedExpertWeights:
    layers = engine.runner.model.weights.layers  # type: ignore[attr-defined]
    moe = layers[1].mlp
    assert type(moe.router.gate) is Linear and moe.router.gate.weight.dtype == torch.float32
    assert isinstance(layers[0].mlp.up, QuantizedLinear)  # the dense layers' MLP too
    assert isinstance(layers[1].attention.qkv, QuantizedLinear)
    experts = moe.experts
    assert isinstance(experts, QuantizedExpertWeights) and experts.num_experts == 8
    return experts


def _resident(experts: QuantizedExpertWeights) -> int:
    return sum(p.nbytes for ps in (experts.gate, experts.up, experts.down) for p in ps)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("scheme", "bits"), [("w4a16", 4), ("w8a16", 8)])
def test_compressed_tensors_moe_checkpoint(
    zoo_model, tmp_path: Path, scheme: str, bits: int
) -> None:
    path = compress_moe(zoo_model("qwen3_moe"), tmp_path / scheme, scheme, ROUTER_IGNORED)
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    experts = _experts(engine)
    gate = experts.gate[5]
    assert isinstance(gate, CompressedWeight) and gate.packed and gate.args.bits == bits
    assert gate.values.dtype == torch.int32 and gate.values.shape == (32, 64 * bits // 32)
    reference = moe_reference(path)
    # the reference's experts are the library's decompression: batchgen's, exactly
    fused = reference.model.layers[1].mlp.experts
    for e in range(8):
        gate_up = torch.cat([p.dequantize(0, 32) for p in (experts.gate[e], experts.up[e])])
        assert torch.equal(gate_up, fused.gate_up_proj[e].detach())
        assert torch.equal(experts.down[e].dequantize(0, 64), fused.down_proj[e].detach())
    ties = _check_matches(engine, reference)
    print(f"compressed-tensors {scheme} MoE near ties: {ties or 'none'}")
    # resident: the packed values and the fp32 scales (w4a16: a group of 32; w8a16: a row)
    numel, rows = 8 * 3 * 32 * 64, 8 * (32 + 32 + 64)
    scales = numel // 32 if bits == 4 else rows
    assert _resident(experts) == numel * bits // 8 + 4 * scales
    print(f"{scheme} layer 1 experts: {_resident(experts)} bytes resident, {2 * numel} in bf16")


def test_gptq_moe_checkpoint(zoo_model, tmp_path: Path) -> None:
    path, plain = quantize_gptq(
        zoo_model("qwen3_moe"), tmp_path / "gptq", tmp_path / "plain", group=32,
        act_order=True, projections=PROJECTIONS,
    )  # fmt: skip
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    experts = _experts(engine)
    assert all(isinstance(p, GptqWeight) for p in (*experts.gate, *experts.up, *experts.down))
    assert experts.down[2].qweight.shape == (4, 64)  # type: ignore[attr-defined]
    ties = _check_matches(engine, _plain_reference(plain))
    print(f"GPTQ MoE near ties: {ties or 'none'}")
    print(
        f"GPTQ layer 1 experts: {_resident(experts)} bytes resident, {2 * 8 * 3 * 32 * 64} in bf16"
    )


def test_awq_moe_checkpoint(zoo_model, tmp_path: Path) -> None:
    """AutoAWQ's MoE releases list the router in modules_to_not_convert (``gate``)."""
    path, plain = quantize_awq(
        zoo_model("qwen3_moe"), tmp_path / "awq", tmp_path / "plain", group=32,
        projections=PROJECTIONS, skip=("gate",),
    )  # fmt: skip
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    experts = _experts(engine)
    assert all(isinstance(p, AwqWeight) for p in (*experts.gate, *experts.up, *experts.down))
    ties = _check_matches(engine, _plain_reference(plain))
    print(f"AWQ MoE near ties: {ties or 'none'}")


def _plain_reference(path: Path) -> object:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def test_quantized_router_refused(zoo_model, tmp_path: Path) -> None:
    """An ignore list without the router: the library quantizes it, and the load names it."""
    path = compress_moe(zoo_model("qwen3_moe"), tmp_path / "ct", "w4a16", ("lm_head",))
    with pytest.raises(UnsupportedModelError, match=r"quantizes the MoE router model\.layers\.1"):
        Engine.from_pretrained(path, num_kv_blocks=64)


def test_w8a8_experts_refused(zoo_model, tmp_path: Path) -> None:
    """Experts whose inputs the scheme quantizes (int8 W8A8) are refused by name: the expert
    product runs no activation quantization."""
    path = compress_moe(zoo_model("qwen3_moe"), tmp_path / "ct", "w8a8-int8", ROUTER_IGNORED)
    with pytest.raises(UnsupportedModelError, match="quantizes the routed experts' inputs"):
        Engine.from_pretrained(path, num_kv_blocks=64)
