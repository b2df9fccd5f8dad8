"""``quantization="fp8"`` (``--quantization fp8``): an unquantized checkpoint's projections
quantized to FP8 at load, as vLLM's online dynamic FP8 does.

Each projection's weight (N out, K in), read in fp32 from the checkpoint,
becomes float8_e4m3fn with one fp32 scale per output channel, scale =
max|row| / 448 (the e4m3 range), value = clamp(w / scale, -448, 448) cast to
e4m3 (round to nearest even); at run time each token's input is quantized
to e4m3 with its own scale, max|x| / 448, and dequantized before the
product. That is exactly what a compressed-tensors FP8-dynamic checkpoint
stores and runs (``float-quantized``, strategy channel, dynamic per-token
input activations, as llm-compressor writes it from the same weights), so the
weights are that format's ``CompressedWeight`` and the activations its
``ActivationArgs``: one math for both, kept FP8 in memory and dequantized a
tile at a time inside the product (``linear.QuantizedLinear``). It is an
approximation of the checkpoint, not the checkpoint: its error is measured
(tests/test_online_fp8.py, benchmarks/quant_bench.py), not claimed away.

What it quantizes: the projections read through ``linear.read_quantized``,
dense attention's q/k/v/o and dense MLPs' gate/up/down. The embedding, the LM
head, norms, MoE routers and experts and MLA attention stay in the model's
dtype, as do the projections of families reordered or transposed at load
(refused, as for every quantized checkpoint). A checkpoint that is already
quantized, the transformers backend and tensor parallelism are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from batchgen.worker.models.model_config import ModelConfig
from batchgen.worker.models.quant.compressed_tensors import (
    FP8_CHANNEL,
    FP8_MAX,
    ActivationArgs,
    CompressedWeight,
)
from batchgen.worker.models.quant.linear import QuantizedLinear
from batchgen.worker.models.quant.scheme import QuantizedWeight, Scheme
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError

# compressed-tensors' FP8-dynamic: e4m3 weights with a scale per output channel
# (FP8_CHANNEL), and each token's input quantized to e4m3 with its own scale
FP8_PER_TOKEN = ActivationArgs(kind="float")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (float8_e4m3fn (N, K), fp32 scales (N, 1)); a row of zeros keeps a
    tiny scale (its values are 0 whatever it is)."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return torch.clamp(w / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@dataclass(frozen=True, slots=True)
class OnlineFp8Scheme(Scheme):
    """Every projection ``read_quantized`` asks for, quantized as it is read."""

    method: str = "online fp8"  # what refusals call it: not a checkpoint's quant_method

    def quantizes(self, module: str) -> bool:
        return True

    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        weight = store.take(f"{module}.weight", float32=True)
        if weight.dim() != 2:
            store.refuse(f"{module}.weight", f"{weight.dim()}-d, not a projection")
        values, scale = quantize_per_channel(weight)
        n, k = values.shape
        return CompressedWeight(values, scale, None, FP8_CHANNEL, (n, k), packed=False)

    def activation(
        self, store: TensorStore, module: str
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return FP8_PER_TOKEN


ONLINE: dict[str, Scheme] = {"fp8": OnlineFp8Scheme()}


def quantized_at_load(config: ModelConfig, quantization: str) -> ModelConfig:
    """The native family's config with its projections to be quantized as they load
    (``quantization`` one of ``ONLINE``); a checkpoint already quantized is refused."""
    if config.quantization is not None:
        raise UnsupportedModelError(
            f"quantization {quantization!r}: this {config.family} checkpoint is already "
            f"quantized (quant_method {config.quantization.method}); it runs as stored, "
            "without --quantization, which quantizes bf16/fp16/fp32 checkpoints"
        )
    return replace(config, quantization=ONLINE[quantization])


def summary(model: object) -> str:
    """One line for the worker's log: the projections held quantized and their bytes
    against the same projections in bf16."""
    found: list[QuantizedLinear] = []

    def walk(obj: object) -> None:
        if isinstance(obj, QuantizedLinear):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    walk(getattr(model, "weights", None))
    held = sum(p.nbytes for p in found)
    bf16 = sum(2 * p.weight.numel() for p in found)  # weight: the (in, out) shape, on meta
    return (
        f"{len(found)} projections held in FP8 e4m3, {held / 2**20:.1f} MiB "
        f"({held / max(bf16, 1):.2f} of their {bf16 / 2**20:.1f} MiB in bf16); embedding, "
        "LM head, norms and any MoE experts stay in the model's dtype"
    )
