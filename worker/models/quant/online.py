"""``quantization="fp8"`` / ``"int8"`` (``--quantization``): an unquantized checkpoint's
projections quantized at load, as vLLM's online dynamic FP8 and W8A8 int8 do.

Each projection's weight (N out, K in), read in fp32 from the checkpoint, gets
one fp32 scale per output channel and is kept quantized:

- ``fp8``: float8_e4m3fn, scale = max|row| / 448 (the e4m3 range), value =
  clamp(w / scale, -448, 448) cast to e4m3 (round to nearest even); each
  token's input is quantized to e4m3 with its own scale, max|x| / 448, and
  dequantized before the product, tile by tile (``linear.QuantizedLinear``).
  That is compressed-tensors' FP8-dynamic (``float-quantized``, strategy
  channel, dynamic per-token input activations).
- ``int8``: int8, symmetric, scale = max|row| / 127.5, value =
  round(clamp(w / scale, -128, 127)); each token's input is quantized to int8
  the same way with its own scale at run time, and the product is int8 x int8
  in int32 (``torch._int_mm`` over the stored int8 weights), each sum scaled by
  its token's and its channel's scale: the W8A8 int8 CPU path of
  ``linear.QuantizedLinear``. That is compressed-tensors' W8A8 int8
  (``int-quantized``, strategy channel, dynamic per-token int8 activations, as
  llm-compressor writes it: its scale is amax / (255 / 2)). CPU only: batchgen
  has no GPU int8 product, so CUDA refuses it (worker/engine_config.py).

Either way the weights are that compressed-tensors format's ``CompressedWeight``
and the activations its ``ActivationArgs``: one math for a checkpoint stored in
the format and for one quantized here (the int8 weights are rounded by the very
function that rounds the activations). It is an approximation of the
checkpoint, not the checkpoint: its error is measured (tests/test_online_fp8.py,
tests/test_online_int8.py, benchmarks/quant_bench.py), not claimed away.

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
    WeightArgs,
)
from batchgen.worker.models.quant.linear import QuantizedLinear
from batchgen.worker.models.quant.scheme import QuantizedWeight, Scheme
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError

# compressed-tensors' FP8-dynamic: e4m3 weights with a scale per output channel
# (FP8_CHANNEL), and each token's input quantized to e4m3 with its own scale
FP8_PER_TOKEN = ActivationArgs(kind="float")
# compressed-tensors' W8A8 int8: symmetric int8 weights with a scale per output channel,
# and each token's input quantized to int8 with its own scale
INT8_CHANNEL = WeightArgs(kind="int", bits=8, symmetric=True, group_size=None)
INT8_PER_TOKEN = ActivationArgs(kind="int")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (float8_e4m3fn (N, K), fp32 scales (N, 1)); a row of zeros keeps a
    tiny scale (its values are 0 whatever it is)."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return torch.clamp(w / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (int8 (N, K), fp32 scales (N, 1)): each output channel rounded as a
    token's input is (``ActivationArgs.quantize``), which is compressed-tensors' symmetric
    int8 (``calculate_qparams``: max(|min|, max) / 127.5, a zero scale made eps)."""
    rounded, scale = INT8_PER_TOKEN.quantize(weight.float())
    return rounded.to(torch.int8), scale


@dataclass(frozen=True, slots=True)
class OnlineScheme(Scheme):
    """Every projection ``read_quantized`` asks for, quantized as it is read."""

    method: str  # what refusals call it ("online fp8"): not a checkpoint's quant_method
    held: str  # what the weights are held in, for the worker's log
    weights: WeightArgs
    activations: ActivationArgs
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def quantizes(self, module: str) -> bool:
        return True

    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        weight = store.take(f"{module}.weight", float32=True)
        if weight.dim() != 2:
            store.refuse(f"{module}.weight", f"{weight.dim()}-d, not a projection")
        values, scale = self.quantize(weight)
        n, k = values.shape
        return CompressedWeight(values, scale, None, self.weights, (n, k), packed=False)

    def activation(
        self, store: TensorStore, module: str
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.activations


# the values of --quantization (worker/engine_config.py's QUANTIZATIONS names them)
ONLINE: dict[str, OnlineScheme] = {
    "fp8": OnlineScheme("online fp8", "FP8 e4m3", FP8_CHANNEL, FP8_PER_TOKEN,
                        quantize_per_channel),
    "int8": OnlineScheme("online int8", "int8", INT8_CHANNEL, INT8_PER_TOKEN,
                         quantize_int8_per_channel),
}  # fmt: skip


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


def summary(model: object, quantization: str) -> str:
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
        f"{len(found)} projections held in {ONLINE[quantization].held}, {held / 2**20:.1f} MiB "
        f"({held / max(bf16, 1):.2f} of their {bf16 / 2**20:.1f} MiB in bf16); embedding, "
        "LM head, norms and any MoE experts stay in the model's dtype"
    )
