"""Routed experts a checkpoint stores quantized, read into the experts the MoE kernels take.

Block-wise FP8 releases (DeepSeek-V3/R1, Qwen3 -FP8) quantize every expert's
gate, up and down projection as they do a dense one (``fp8.py``): each
``{block}.experts.{e}.{gate,up,down}_proj`` has its ``weight`` (e4m3) and
``weight_scale_inv``. They are stacked as stored into ``Fp8BlockExpertWeights``
(``kernels/experts.py``), which the CPU routed-experts product dequantizes one
expert at a time and the Triton fused-MoE kernel a tile at a time inside its
GEMMs (``kernels/triton/fused_moe.py``): they stay FP8 on every device.

GPTQ, AWQ and compressed-tensors MoE releases (Qwen3-30B-A3B-GPTQ-Int4, -AWQ,
RedHatAI's W4A16 and W8A16) quantize each expert's projections in their own
layout too (``qweight``/``qzeros``/``scales``, ``weight_packed``/``weight_scale``):
each is read by its format's module into its ``QuantizedWeight`` and kept so, per
expert, in ``QuantizedExpertWeights``, which the same CPU product dequantizes
one expert with tokens at a time. Experts whose inputs the scheme quantizes too
(W8A8, FP8-dynamic) are refused by name: the expert product runs no activation
quantization.

The Triton fused-MoE kernel has no GEMM for those, so off the CPU they are
dequantized once here, to the model's dtype (the memory of a plain checkpoint; the
tokens are the same).
"""

from __future__ import annotations

import torch

from batchgen.kernels.experts import (
    ExpertWeights,
    Fp8BlockExpertWeights,
    QuantizedExpertWeights,
)
from batchgen.kernels.quant_reference import dequantize_experts
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from batchgen.worker.models.quant.scheme import QuantizedWeight, Scheme
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError


def read_quantized_experts(
    store: TensorStore, experts: list[tuple[str, str, str]]
) -> Fp8BlockExpertWeights | QuantizedExpertWeights | ExpertWeights | None:
    """The experts (each its gate, up and down module names) when the checkpoint quantizes
    them; None when it has no quantization or leaves them plain."""
    scheme = store.quantization
    if scheme is None:
        return None
    quantized = {scheme.quantizes(name) for names in experts for name in names}
    if quantized == {False}:
        return None
    if quantized != {True}:
        raise UnsupportedModelError(
            f"quantization_config ({scheme.method}) quantizes some routed experts' "
            "projections but not others; batchgen reads them all quantized or all plain"
        )
    if any(scheme.activation(store, name) is not None for names in experts for name in names):
        raise UnsupportedModelError(
            f"quantization_config ({scheme.method}) quantizes the routed experts' inputs "
            "(W8A8 or FP8 activations); batchgen runs quantized experts with weight-only "
            "schemes (W4A16, W8A16, GPTQ, AWQ), block-wise fp8 and MXFP4"
        )
    parts = [tuple(scheme.read(store, name) for name in names) for names in experts]
    fp8 = [isinstance(p, Fp8BlockWeight) for ps in parts for p in ps]
    if all(fp8):
        stored: Fp8BlockExpertWeights | QuantizedExpertWeights = _fp8_experts(scheme, parts)
    elif not any(fp8):
        stored = _weights(scheme, parts)
    else:
        raise UnsupportedModelError(
            f"quantization_config ({scheme.method}) stores the routed experts in more than "
            "one format; batchgen reads them in one"
        )
    stored.names = tuple(experts)  # each expert's modules, for refusals (a TP cut's)
    return stored if store.device.type == "cpu" else on_device(stored, store.dtype)


def on_device(
    stored: Fp8BlockExpertWeights | QuantizedExpertWeights, dtype: torch.dtype
) -> Fp8BlockExpertWeights | ExpertWeights:
    """The experts a loader keeps off the CPU: block FP8 as stored, GPTQ / AWQ /
    compressed-tensors dequantized once to ``dtype`` (the Triton fused-MoE kernel has no
    GEMM for them). A tensor-parallel rank's, cut on the CPU, are given here once moved."""
    if isinstance(stored, Fp8BlockExpertWeights):
        return stored
    plain = dequantize_experts(stored)
    return ExpertWeights(plain.w13.to(dtype), plain.w2.to(dtype), activation=plain.activation)


def _weights(scheme: Scheme, parts: list[tuple[QuantizedWeight, ...]]) -> QuantizedExpertWeights:
    """Each expert's gate, up and down as stored; shapes checked as the product needs them."""
    gate, up, down = zip(*parts)
    inter, hidden = gate[0].out_features, gate[0].in_features
    shapes = {(g.out_features, g.in_features, u.out_features, u.in_features,
               d.out_features, d.in_features) for g, u, d in parts}  # fmt: skip
    if shapes != {(inter, hidden, inter, hidden, hidden, inter)}:
        raise UnsupportedModelError(
            f"quantization_config ({scheme.method}): the routed experts' projections differ "
            f"in shape ({sorted(shapes)}); each expert's gate and up must be (inter, hidden) "
            "and its down (hidden, inter)"
        )
    return QuantizedExpertWeights(gate, up, down)


def _fp8_experts(scheme: Scheme, parts: list[tuple[QuantizedWeight, ...]]) -> Fp8BlockExpertWeights:
    gate_up, gate_up_scale, down, down_scale = [], [], [], []
    blocks = set()
    for gate, up, proj in parts:
        assert isinstance(gate, Fp8BlockWeight) and isinstance(up, Fp8BlockWeight)
        assert isinstance(proj, Fp8BlockWeight)
        gate_up.append(torch.cat((gate.weight, up.weight)))
        gate_up_scale.append(torch.cat((gate.scale_inv.float(), up.scale_inv.float())))
        down.append(proj.weight)
        down_scale.append(proj.scale_inv.float())
        blocks |= {gate.block, up.block, proj.block}
    if len(blocks) != 1:
        raise UnsupportedModelError(
            f"quantization_config ({scheme.method}) without weight_block_size: one fp8 scale "
            "per expert projection is not supported (block-wise scales are)"
        )
    return Fp8BlockExpertWeights(
        torch.stack(gate_up), torch.stack(gate_up_scale).contiguous(),
        torch.stack(down), torch.stack(down_scale).contiguous(), blocks.pop(),
    )  # fmt: skip
