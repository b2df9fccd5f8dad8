"""AWQ checkpoints, GEMM packing (``quant_method: awq``, ``version: gemm``, AutoAWQ's layout).

Per quantized projection (K in, N out): ``qweight`` int32 (K, N / 8), eight 4-bit
columns a word in AWQ's interleaved order (field i of a word holds column
``AWQ_ORDER[i]`` of its eight); ``qzeros`` int32 (K / group, N / 8), packed alike;
``scales`` (K / group, N), fp16 as saved. The weight is ``(q - zero) * scale`` of the
row's group, computed in the scale's dtype as AutoAWQ's dequantization does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen.worker.models.quant.packing import unpack
from batchgen.worker.models.quant.scheme import Options, QuantizedWeight, Scheme, transformers_skips
from batchgen.worker.models.tensor_store import TensorStore

if TYPE_CHECKING:
    from batchgen.kernels.ops import QuantGemms

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word field i holds column AWQ_ORDER[i]
_COLUMN_FIELD = [AWQ_ORDER.index(c) for c in range(8)]  # column c sits in this field


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """(rows, N / 8) int32 -> (rows, N) unsigned 4-bit values in column order."""
    fields = unpack(words, 4, dim=1).unflatten(1, (-1, 8))
    return fields[..., _COLUMN_FIELD].flatten(1)


@dataclass(slots=True)
class AwqWeight(QuantizedWeight):
    qweight: torch.Tensor  # int32 (K, N / 8)
    qzeros: torch.Tensor  # int32 (K / group, N / 8)
    scales: torch.Tensor  # (K / group, N)
    group_size: int

    @property
    def out_features(self) -> int:
        return self.scales.shape[1]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def column_step(self) -> int:
        return 8

    def dequantize(self, start: int, stop: int) -> torch.Tensor:
        words = slice(start // 8, -(-stop // 8))
        q = unpack_awq(self.qweight[:, words])[:, : stop - start]  # (K, n)
        zeros = unpack_awq(self.qzeros[:, words])[:, : stop - start]
        scales = self.scales[:, start:stop]
        zeros = zeros.repeat_interleave(self.group_size, 0)
        scales = scales.repeat_interleave(self.group_size, 0)
        return ((q - zeros).to(scales.dtype) * scales).float().t()

    def kernel(self, gemms: QuantGemms) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return functools.partial(
            gemms.awq, qweight=self.qweight, qzeros=self.qzeros, scales=self.scales
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qweight, self.qzeros, self.scales)


@dataclass(frozen=True, slots=True)
class AwqScheme(Scheme):
    group_size: int
    not_converted: tuple[str, ...] | None
    method: str = "awq"

    def quantizes(self, module: str) -> bool:
        return not transformers_skips(module, self.not_converted)

    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        qweight = store.take_stored(f"{module}.qweight")
        qzeros = store.take_stored(f"{module}.qzeros")
        scales = store.take_stored(f"{module}.scales")
        k, n, group = qweight.shape[0], qweight.shape[1] * 8, self.group_size
        groups = f"{k} inputs in groups of {group}"
        if k % group:
            store.refuse(f"{module}.scales", f"{groups}: the last group is partial")
        self.check_shape(store, f"{module}.scales", scales, (k // group, n), groups)
        self.check_shape(store, f"{module}.qzeros", qzeros, (k // group, n // 8), groups)
        return AwqWeight(qweight, qzeros, scales, self.group_size)


def read_awq(raw: dict[str, Any]) -> AwqScheme:
    o = Options(raw, "awq")
    o.get("bits", 4, allowed=[4])
    group_size = o.get("group_size", 128)
    if not isinstance(group_size, int) or group_size < 1:
        raise o.refuse("group_size", "a positive group size")
    o.get("zero_point", True, allowed=[True])
    version = str(o.get("version", "gemm")).lower()
    if version != "gemm":
        raise o.refuse("version", "batchgen runs the GEMM packing")
    for loading in ("backend", "do_fuse", "fuse_max_seq_len", "exllama_config"):
        o.get(loading)  # which kernel transformers would pick; not the math
    skips = o.get("modules_to_not_convert")
    o.check_all_read()
    return AwqScheme(group_size, None if skips is None else tuple(skips))
