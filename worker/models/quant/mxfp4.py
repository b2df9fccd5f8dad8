"""MXFP4 experts (``quant_method: mxfp4``: gpt-oss-20b and gpt-oss-120b as OpenAI ships them).

Only gpt-oss's routed experts are quantized (transformers' MXFP4 integration
replaces no other module): each layer's ``mlp.experts`` holds, per stacked
projection, ``{gate_up,down}_proj_blocks`` uint8 (E, N, K/32, 16), two e2m1
values a byte, the low nibble first, and ``{gate_up,down}_proj_scales`` uint8
(E, N, K/32), one e8m0 scale 2^(s-127) per 32 inputs; N is the output (gate_up:
2 * intermediate, its rows interleaving gate and up; down: hidden). Biases
(``*_proj_bias``) are plain. Attention, router, embeddings and lm_head stay
plain, as ``modules_to_not_convert`` lists them; an experts module it lists
(matched as transformers matches it) is read as plain ``gate_up_proj`` /
``down_proj`` tensors.

The experts are kept as these tensors (``kernels.experts.Mxfp4ExpertWeights``):
about a quarter of their bf16 bytes, plus a scale byte per 32 weights. The CPU
product dequantizes one expert at a time, only the experts a step's tokens chose
(``kernels/cpu/routed_experts.py``); the Triton fused-MoE kernel dequantizes
inside its loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen.kernels.experts import Mxfp4ExpertWeights
from batchgen.worker.models.quant.scheme import Options, QuantizedWeight, Scheme, transformers_skips
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError

BLOCK = 32  # inputs sharing one e8m0 scale


@dataclass(frozen=True, slots=True)
class Mxfp4Scheme(Scheme):
    not_converted: tuple[str, ...] | None
    method: str = "mxfp4"

    def quantizes(self, module: str) -> bool:
        """Only a gpt-oss layer's routed experts (``model.layers.0.mlp.experts``)."""
        return module.endswith(".mlp.experts") and not transformers_skips(
            module, self.not_converted
        )

    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        raise UnsupportedModelError(  # quantizes() holds no projection: never reached
            f"quantization_config (mxfp4) quantizes only gpt-oss's routed experts, not {module}"
        )


def read_mxfp4(raw: dict[str, Any]) -> Mxfp4Scheme:
    options = Options(raw, "mxfp4")
    options.get("dequantize")  # a loading choice of transformers; the math is the same
    skips = options.get("modules_to_not_convert")
    options.check_all_read()
    return Mxfp4Scheme(None if skips is None else tuple(skips))


def read_mxfp4_experts(
    store: TensorStore, module: str, num_experts: int, hidden: int, inter: int
) -> Mxfp4ExpertWeights | None:
    """The stacked experts ``module`` (``model.layers.0.mlp.experts``) as stored, when the
    checkpoint is MXFP4 and quantizes them; None: they are plain tensors."""
    scheme = store.quantization
    if not isinstance(scheme, Mxfp4Scheme) or not scheme.quantizes(module):
        return None
    if hidden % BLOCK or inter % BLOCK:
        raise UnsupportedModelError(
            f"mxfp4 experts need hidden_size and intermediate_size multiples of {BLOCK}, "
            f"got {hidden} and {inter}"
        )
    tensors = {}
    for proj, (n, k) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
        for suffix, shape in (("blocks", (num_experts, n, k // BLOCK, 16)),
                              ("scales", (num_experts, n, k // BLOCK))):  # fmt: skip
            name = f"{module}.{proj}_{suffix}"
            tensor = store.take_stored(name)
            if tensor.dtype != torch.uint8 or tuple(tensor.shape) != shape:
                store.refuse(
                    name,
                    f"{tensor.dtype} {tuple(tensor.shape)}, not the uint8 {shape} of MXFP4",
                )
            tensors[f"{proj}_{suffix}"] = tensor.contiguous()
    return Mxfp4ExpertWeights(
        tensors["gate_up_proj_blocks"], tensors["gate_up_proj_scales"],
        tensors["down_proj_blocks"], tensors["down_proj_scales"],
        gate_up_bias=store.take(f"{module}.gate_up_proj_bias").contiguous(),
        down_bias=store.take(f"{module}.down_proj_bias").contiguous(),
    )  # fmt: skip
