"""GPTQ, AWQ and compressed-tensors MoE checkpoints (Qwen3-30B-A3B-GPTQ-Int4, -AWQ, RedHatAI's
W4A16 MoE) run with their routed experts kept in the checkpoint's packed integers, and give
the dequantized model's tokens.

Tiny random Qwen3-MoE checkpoints (zoo ``qwen3_moe``: layer 1 sparse, 8 experts of
hidden 64, inter 32; layers 0 and 2 dense) written offline in each format's
on-disk layout, each expert's projections named as the releases name them
(``model.layers.1.mlp.experts.3.gate_proj.weight_packed``, ``.qweight``...):

- compressed-tensors W4A16 / W8A16 (qwen3_moe; and Mixtral, zoo ``mixtral``: 4 experts of
  inter 96, ``block_sparse_moe.experts.E.w1/w3/w2``), written by the compressed-tensors
  library (``tests/quant_moe_checkpoints.py``), the router left plain by the ignore list as
  llm-compressor's MoE recipes leave it. Reference: transformers in fp32 with
  ``CompressedTensorsConfig(dequantize=True)``, which decompresses each expert with the
  library and fuses them (and whose expert weights equal batchgen's dequantized ones
  exactly, checked). Asymmetric W4A16 experts transformers refuses ("Asymmetric quant
  requires zero-point values": its MoE decompression drops them), so there the
  reference is the format's definition in plain torch (``ct_dequantized``).
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
from safetensors.torch import load_file

from batchgen import Engine
from batchgen.kernels.experts import QuantizedExpertWeights
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.quant import QuantizedLinear
from batchgen.worker.models.quant.awq import AwqWeight
from batchgen.worker.models.quant.compressed_tensors import CompressedWeight
from batchgen.worker.models.quant.gptq import GptqWeight
from batchgen.worker.models.weights import Linear
from tests.quant_checkpoints import quantize_awq, quantize_gptq
from tests.quant_moe_checkpoints import compress_moe, ct_dequantized, moe_reference
from tests.test_quantized_models import _check_matches

# the releases' quantized projections: attention, dense MLP, each routed expert's (not the router)
PROJECTIONS = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?\w+_proj\.weight$")
ROUTER_IGNORED = ("lm_head", "re:.*mlp.gate$")  # RedHatAI's MoE releases' ignore list


def _experts(engine: Engine, num: int = 8) -> QuantizedExpertWeights:
    """Layer 1's routed experts, kept quantized; its router plain; attention (and qwen3_moe's
    dense layer 0 MLP) quantized too."""
    layers = engine.runner.model.weights.layers  # type: ignore[attr-defined]
    moe = layers[1].mlp
    assert type(moe.router.gate) is Linear and moe.router.gate.weight.dtype == torch.float32
    assert isinstance(layers[1].attention.qkv, QuantizedLinear)
    if num == 8:  # qwen3_moe: layer 0 is dense
        assert isinstance(layers[0].mlp.up, QuantizedLinear)
    experts = moe.experts
    assert isinstance(experts, QuantizedExpertWeights) and experts.num_experts == num
    return experts


def _resident(experts: QuantizedExpertWeights) -> int:
    return sum(p.nbytes for ps in (experts.gate, experts.up, experts.down) for p in ps)  # type: ignore[attr-defined]


def _stored(path: Path, layer: str) -> int:
    """Bytes the checkpoint stores for ``layer``'s experts (their ``weight_shape`` aside)."""
    tensors = load_file(str(path / "model.safetensors"))
    return sum(t.nbytes for n, t in tensors.items() if n.startswith(layer) and "shape" not in n)


@pytest.mark.parametrize(
    ("zoo", "scheme", "reference"),
    [
        ("qwen3_moe", "w4a16", "transformers"),  # int4, groups of 32, symmetric
        ("qwen3_moe", "w8a16", "transformers"),  # int8, a scale per row
        ("mixtral", "w4a16", "transformers"),  # block_sparse_moe.experts.E.w1/w3/w2
        # transformers' MoE decompression drops zero points (and refuses): the definition
        ("qwen3_moe", "w4a16-asym", "definition"),
    ],
)
def test_compressed_tensors_moe_checkpoint(
    zoo_model, tmp_path: Path, zoo: str, scheme: str, reference: str
) -> None:
    block = "mlp" if zoo == "qwen3_moe" else "block_sparse_moe"
    ignore = ("lm_head", f"re:.*{block}.gate$")
    path = compress_moe(zoo_model(zoo), tmp_path / scheme, scheme, ignore)
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    experts = _experts(engine, 8 if zoo == "qwen3_moe" else 4)
    gate = experts.gate[3]
    bits = 8 if scheme == "w8a16" else 4
    assert isinstance(gate, CompressedWeight) and gate.packed and gate.args.bits == bits
    assert gate.values.dtype == torch.int32
    assert _resident(experts) == _stored(path, f"model.layers.1.{block}.experts.")
    if reference == "transformers":
        model = moe_reference(path)
        # the reference's experts are the library's decompression: batchgen's, exactly
        fused = model.model.layers[1].mlp.experts
        for e in range(experts.num_experts):
            parts = (experts.gate[e], experts.up[e], experts.down[e])
            gate_up, down = (torch.cat([p.dequantize(0, p.out_features) for p in ps])
                             for ps in (parts[:2], parts[2:]))  # fmt: skip
            assert torch.equal(gate_up, fused.gate_up_proj[e].detach())
            assert torch.equal(down, fused.down_proj[e].detach())
    else:
        model = _plain_reference(ct_dequantized(path, tmp_path / "plain"))
    ties = _check_matches(engine, model)
    print(f"compressed-tensors {scheme} {zoo} near ties: {ties or 'none'}")
    stored = _resident(experts)
    numel = experts.num_experts * 3 * gate.out_features * gate.in_features
    print(f"{scheme} {zoo} layer 1 experts: {stored} bytes resident, {2 * numel} in bf16")


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


def test_the_ops_take_quantized_experts_as_stored(
    zoo_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU product and the Triton fused_moe (under the interpreter: dequantized whole
    for the call) both run W4A16 experts as stored (asymmetric: zero points packed eight
    rows a word) as their dequantized weights: the ops keep one signature. The CPU product
    dequantizes a tile of output features at a time: with tiles of 8 rows (4 over gate and
    up's 32, 8 over down's 64, each aligned to the packed zero points' words) it gives the
    same values as with the whole expert in one tile."""
    pytest.importorskip("triton")
    from batchgen.kernels import quant_reference as qref
    from batchgen.kernels.cpu import routed_experts
    from batchgen.kernels.triton.op_set import TRITON_OPS

    path = compress_moe(zoo_model("qwen3_moe"), tmp_path / "ct", "w4a16-asym", ROUTER_IGNORED)
    experts = _experts(Engine.from_pretrained(path, num_kv_blocks=64))
    plain = qref.dequantize_experts(experts)
    torch.manual_seed(0)
    x, weights = torch.randn(6, 64), torch.rand(6, 2)
    ids = torch.tensor([[0, 7], [7, 1], [1, 0], [3, 2], [2, 5], [5, 7]])
    want = routed_experts.fused_moe(x, plain, weights, ids)
    whole = routed_experts.fused_moe(x, experts, weights, ids)
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)
    tiles: list[tuple[int, int]] = []
    tiling = routed_experts._tiles
    monkeypatch.setattr(routed_experts, "TILE_BYTES", 8 * 4 * 32)  # 8 rows of down's 32 inputs

    def spy(rows: int, columns: int, step: int) -> list[tuple[int, int]]:
        tiles.extend(tiling(rows, columns, step))
        return tiling(rows, columns, step)

    monkeypatch.setattr(routed_experts, "_tiles", spy)
    tiled = routed_experts.fused_moe(x, experts, weights, ids)
    assert tiles[:12] == [(0, 8), (8, 16), (16, 24), (24, 32)] + [
        (i, i + 8) for i in range(0, 64, 8)
    ]
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)
    triton = TRITON_OPS.fused_moe(x, experts, weights, ids)
    torch.testing.assert_close(triton, want, rtol=1e-4, atol=1e-4)
