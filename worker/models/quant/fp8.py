"""FP8 e4m3 weights with block-wise scales (``quant_method: fp8``, DeepSeek-V3/R1, Qwen3-FP8).

On disk each quantized projection is ``NAME.weight`` (float8_e4m3fn, (N, K),
HF's out x in) and ``NAME.weight_scale_inv`` (fp32 or bf16, a grid of
(ceil(N / bn), ceil(K / bk)) for ``weight_block_size`` [bn, bk]; the last
row/column of blocks is partial where bn or bk does not divide the shape);
the weight is ``fp8 * scale_inv`` of its block, computed in fp32 as
transformers' ``FineGrainedFP8Config(dequantize=True)`` does. With no
``weight_block_size`` one scale covers the whole tensor.

``activation_scheme: dynamic`` quantizes each token's activations on the Triton
ops (DeepSeek-V3's per-token-group w8a8, ``kernels/triton/fp8_gemm.py``, for
blocks whose bk is a power of two >= 16); on the CPU path the activations stay
in the model's dtype, as transformers' dequantized model runs them. ``static``
activation scales, ``ue8m0`` scales, FP4 experts and quantized embeddings
(``modules_to_convert``) are refused by name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen.worker.models.quant.scheme import Options, QuantizedWeight, Scheme, transformers_skips
from batchgen.worker.models.tensor_store import TensorStore

if TYPE_CHECKING:
    from batchgen.kernels.ops import QuantGemms


@dataclass(slots=True)
class Fp8BlockWeight(QuantizedWeight):
    weight: torch.Tensor  # float8_e4m3fn (N, K)
    scale_inv: torch.Tensor  # (ceil(N / bn), ceil(K / bk)), as stored
    block: tuple[int, int]  # (bn, bk)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def column_step(self) -> int:
        return self.block[0]

    def dequantize(self, start: int, stop: int) -> torch.Tensor:
        bn, bk = self.block
        scale = self.scale_inv[start // bn : math.ceil(stop / bn)].float()
        scale = scale.repeat_interleave(bn, 0)[: stop - start].repeat_interleave(bk, 1)
        return self.weight[start:stop].float() * scale[:, : self.in_features]

    def kernel(self, gemms: QuantGemms) -> Callable[[torch.Tensor], torch.Tensor] | None:
        bk = self.block[1]
        if bk < 16 or bk & (bk - 1):  # the GEMM steps along K in powers of two within a block
            return None
        return functools.partial(
            gemms.fp8_block, weight=self.weight.contiguous(),
            weight_scale_inv=self.scale_inv.contiguous(), block_size=self.block,
        )  # fmt: skip

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.weight, self.scale_inv)

    def rows_reordered(self, order: torch.Tensor) -> Fp8BlockWeight | None:
        """Output feature i becomes stored row ``order[i]``, the scales unchanged; None when
        a row would leave its block of bn rows (its scale would then differ)."""
        rows = torch.arange(self.out_features, device=order.device)
        if not torch.equal(order // self.block[0], rows // self.block[0]):
            return None
        return Fp8BlockWeight(self.weight[order.to(self.weight.device)], self.scale_inv, self.block)


@dataclass(frozen=True, slots=True)
class Fp8BlockScheme(Scheme):
    block: tuple[int, int] | None  # None: one scale per tensor
    not_converted: tuple[str, ...] | None
    method: str = "fp8"

    def quantizes(self, module: str) -> bool:
        return not transformers_skips(module, self.not_converted)

    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        weight = store.take_stored(f"{module}.weight")
        scale = store.take_stored(f"{module}.weight_scale_inv")
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            store.refuse(
                f"{module}.weight", f"fp8 checkpoint holds {weight.dtype} {weight.dim()}-d"
            )
        n, k = weight.shape
        block = self.block or (n, k)
        grid = (math.ceil(n / block[0]), math.ceil(k / block[1]))
        if self.block is None and scale.numel() == 1:
            scale = scale.reshape(grid)  # one scale: stored as a scalar or (1,)
        self.check_shape(
            store, f"{module}.weight_scale_inv", scale, grid, f"({n}, {k}) in blocks of {block}"
        )
        return Fp8BlockWeight(weight, scale, block)


def read_fp8(raw: dict[str, Any]) -> Fp8BlockScheme:
    options = Options(raw, "fp8")
    options.get("activation_scheme", "dynamic", allowed=["dynamic"])
    options.get("fmt", "e4m3", allowed=["e4m3"])
    options.get("scale_fmt", "float", allowed=["float"])
    options.get("expert_dtype", "fp8", allowed=["fp8"])
    options.get("dequantize")  # a loading choice of transformers; the math is the same
    if options.get("modules_to_convert"):
        raise options.refuse("modules_to_convert", "quantized embedding tables")
    block = options.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise options.refuse("weight_block_size", "two positive sizes")
    skips = options.get("modules_to_not_convert")
    if skips is None:
        skips = options.get("ignored_layers")  # MiniMax's name for it, as transformers reads it
    options.check_all_read()
    block_size = None if block is None else (int(block[0]), int(block[1]))
    return Fp8BlockScheme(block_size, None if skips is None else tuple(skips))
