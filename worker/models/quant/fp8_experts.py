"""Routed experts a checkpoint stores quantized, read into the experts the MoE kernels take.

Block-wise FP8 releases (DeepSeek-V3/R1, Qwen3 -FP8) quantize every expert's
gate, up and down projection as they do a dense one (``fp8.py``): each
``{block}.experts.{e}.{gate,up,down}_proj`` has its ``weight`` (e4m3) and
``weight_scale_inv``. They are stacked as stored into ``Fp8BlockExpertWeights``
(``kernels/experts.py``), which the CPU routed-experts product dequantizes one
expert at a time. The Triton fused-MoE kernel reads plain and MXFP4 experts
only, so off the CPU the experts are dequantized once here, to the model's
dtype (the memory of a plain checkpoint; the tokens are the same).
"""

from __future__ import annotations

import torch

from batchgen.kernels.experts import ExpertWeights, Fp8BlockExpertWeights
from batchgen.kernels.quant_reference import dequantize_fp8_block_experts
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError


def read_quantized_experts(
    store: TensorStore, experts: list[tuple[str, str, str]]
) -> Fp8BlockExpertWeights | ExpertWeights | None:
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
    gate_up, gate_up_scale, down, down_scale = [], [], [], []
    blocks = set()
    for names in experts:
        parts = [scheme.read(store, name) for name in names]
        if not all(isinstance(p, Fp8BlockWeight) for p in parts):
            raise UnsupportedModelError(
                f"quantization_config ({scheme.method}) quantizes the routed experts; batchgen "
                "runs quantized experts in block-wise fp8 (and gpt-oss's MXFP4) only"
            )
        gate, up, proj = (p for p in parts if isinstance(p, Fp8BlockWeight))
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
    fp8 = Fp8BlockExpertWeights(
        torch.stack(gate_up), torch.stack(gate_up_scale), torch.stack(down),
        torch.stack(down_scale), blocks.pop(),
    )  # fmt: skip
    if store.device.type == "cpu":
        return fp8
    plain = dequantize_fp8_block_experts(fp8)
    return ExpertWeights(plain.w13.to(store.dtype), plain.w2.to(store.dtype))
