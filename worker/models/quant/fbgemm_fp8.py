"""fbgemm FP8 checkpoints (``quant_method: fbgemm_fp8``, transformers' ``FbgemmFp8Config``).

On disk each quantized projection is ``NAME.weight`` (float8_e4m3fn, (N, K))
and ``NAME.weight_scale`` (fp32, (N, 1)): one scale per output channel, the
weight ``fp8 * scale``. That is compressed-tensors' FP8 per-channel weight, so
it is held as that format's ``CompressedWeight`` (one dequantizing rule, and
tensor parallelism cuts it alike).

At run time each token's input is quantized as fbgemm's
``quantize_fp8_per_row`` does (the op transformers' ``FbgemmFp8Linear`` calls,
its CUDA definition): the row's largest magnitude, bounded by
``activation_scale_ub``, over 448 is the row's scale (at least
1 / (448 * 512)); the row divided by it, saturated to +-448 and cast to e4m3,
all in fp32 (``RowwiseFp8Input``). The product then multiplies the e4m3 rows
by the e4m3 weights and both scales; on the CPU both are dequantized and
multiplied in the model's dtype (fbgemm's ``f8f8bf16_rowwise`` sums in fp32
and rounds its output to bf16 on the GPU).

``modules_to_not_convert`` is matched as transformers matches it; with none,
transformers leaves the LM head plain, and a list that leaves ``lm_head``
quantized is refused by name, as is every key transformers does not read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.worker.models.quant.compressed_tensors import FP8_CHANNEL, FP8_MAX, CompressedWeight
from batchgen.worker.models.quant.scheme import Options, QuantizedWeight, Scheme, transformers_skips
from batchgen.worker.models.tensor_store import TensorStore

MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # fbgemm's min_scaling_factor


@dataclass(frozen=True, slots=True)
class RowwiseFp8Input:
    """fbgemm's ``quantize_fp8_per_row`` with ``scale_ub``, quantized and dequantized."""

    bound: float  # activation_scale_ub: the largest magnitude a row's scale covers

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float()
        top = rows.abs().amax(dim=-1, keepdim=True).clamp(max=self.bound)
        scale = torch.clamp(top / FP8_MAX, min=MIN_SCALE)
        q = torch.clamp(rows / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (q.float() * scale).to(x.dtype)


@dataclass(frozen=True, slots=True)
class FbgemmFp8Scheme(Scheme):
    bound: float
    not_converted: tuple[str, ...]
    method: str = "fbgemm_fp8"

    def quantizes(self, module: str) -> bool:
        return not transformers_skips(module, self.not_converted)

    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        weight = store.take_stored(f"{module}.weight")
        scale = store.take_stored(f"{module}.weight_scale")
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            store.refuse(f"{module}.weight", f"fbgemm_fp8 holds {weight.dtype} {weight.dim()}-d")
        n, k = weight.shape
        self.check_shape(store, f"{module}.weight_scale", scale, (n, 1), f"{n} output channels")
        if not scale.is_floating_point():
            store.refuse(f"{module}.weight_scale", f"{scale.dtype}, not a float scale")
        return CompressedWeight(weight, scale, None, FP8_CHANNEL, (n, k), packed=False)

    def activation(
        self, store: TensorStore, module: str
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return RowwiseFp8Input(self.bound)


def read_fbgemm_fp8(raw: dict[str, Any]) -> FbgemmFp8Scheme:
    options = Options(raw, "fbgemm_fp8")
    bound = options.get("activation_scale_ub", 1200.0)  # FbgemmFp8Config's default
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound > 0:
        raise options.refuse("activation_scale_ub", "a positive number")
    skips = options.get("modules_to_not_convert")
    options.check_all_read()
    if skips is None:
        skips = ["lm_head"]  # transformers' default: the output embedding stays plain
    elif not transformers_skips("lm_head", tuple(skips)):
        raise options.refuse("modules_to_not_convert", "it leaves lm_head quantized")
    return FbgemmFp8Scheme(float(bound), tuple(skips))
