"""A quantized projection's shard on one tensor-parallel rank, cut on its format's groups.

Column-parallel keeps a run of each part's output features, row-parallel a run
of its input features (``worker/models/tensor_parallel.py`` says which
projection is which). The weights stay quantized, in the checkpoint's layout,
and every kept value keeps its own scale, so a cut must fall on the format's
boundaries: FP8 block-wise (``Fp8BlockWeight``) on its (bn, bk) blocks;
compressed-tensors (``CompressedWeight``: W4A16/W8A16 packed, W8A8, FP8) on
its scale groups along the input, on whole int32 words of packed values, and
on whole words of a packed zero point down the outputs. Other formats (GPTQ,
AWQ, ...) and a cut inside a group are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from batchgen.worker.models.quant.compressed_tensors import CompressedWeight
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from batchgen.worker.models.quant.linear import QuantizedLinear
from batchgen.worker.models.quant.scheme import QuantizedWeight
from batchgen.worker.worker_errors import UnsupportedModelError

SPLIT_METHODS = ("fp8", "compressed-tensors")  # the quant_methods whose weights are cut here


def column_shard(layer: QuantizedLinear, index: torch.Tensor) -> QuantizedLinear:
    """The output features ``index`` (increasing; one run within each fused part)."""
    parts, offset = [], 0
    for part in layer.parts:
        n = part.out_features
        mine = index[(index >= offset) & (index < offset + n)] - offset
        if mine.numel():
            start, stop = int(mine[0]), int(mine[-1]) + 1
            assert stop - start == mine.numel(), "a column shard keeps one run of each part"
            parts.append(_outputs(part, start, stop))
        offset += n
    bias = None if layer.bias is None else layer.bias.index_select(0, index).contiguous()
    shape = torch.empty(layer.weight.shape[0], index.numel(), device="meta")
    return replace(layer, weight=shape, bias=bias, parts=tuple(parts))


def row_shard(layer: QuantizedLinear, start: int, stop: int, keep_bias: bool) -> QuantizedLinear:
    """The input features [start, stop); the bias only where ``keep_bias`` (added once)."""
    shape = torch.empty(stop - start, layer.weight.shape[1], device="meta")
    parts = tuple(_inputs(part, start, stop) for part in layer.parts)
    return replace(layer, weight=shape, bias=layer.bias if keep_bias else None, parts=parts)


def _on(step: int, start: int, stop: int, size: int, what: str, part: QuantizedWeight) -> None:
    if start % step or (stop % step and stop != size):
        raise UnsupportedModelError(
            f"tensor parallelism would cut a {type(part).__name__}'s {what} features at "
            f"[{start}, {stop}) of {size}, inside its groups of {step}; use a "
            "tensor_parallel_size whose shards hold whole groups"
        )


def _outputs(part: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    n = part.out_features
    if isinstance(part, Fp8BlockWeight):
        bn = part.block[0]
        _on(bn, start, stop, n, "output", part)
        scale = part.scale_inv[start // bn : math.ceil(stop / bn)]
        return replace(part, weight=part.weight[start:stop].contiguous(),
                       scale_inv=scale.contiguous())  # fmt: skip
    if isinstance(part, CompressedWeight):
        zero = part.zero_point
        if zero is not None and part.packed:  # packed down the rows: whole words
            per_word = 32 // part.args.bits
            _on(per_word, start, stop, n, "output", part)
            zero = zero[start // per_word : math.ceil(stop / per_word)].contiguous()
        elif zero is not None:
            zero = zero[start:stop].contiguous()
        scale = part.scale if part.scale.numel() == 1 else part.scale[start:stop].contiguous()
        return replace(part, values=part.values[start:stop].contiguous(), scale=scale,
                       zero_point=zero, shape=(stop - start, part.in_features))  # fmt: skip
    raise _refused(part)


def _inputs(part: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    k = part.in_features
    if isinstance(part, Fp8BlockWeight):
        bk = part.block[1]
        _on(bk, start, stop, k, "input", part)
        scale = part.scale_inv[:, start // bk : math.ceil(stop / bk)]
        return replace(part, weight=part.weight[:, start:stop].contiguous(),
                       scale_inv=scale.contiguous())  # fmt: skip
    if isinstance(part, CompressedWeight):
        scale, zero = part.scale, part.zero_point
        if scale.dim() == 2 and scale.shape[1] > 1:  # groups along the input
            group = k // scale.shape[1]
            _on(group, start, stop, k, "input", part)
            scale = scale[:, start // group : stop // group].contiguous()
            zero = None if zero is None else zero[:, start // group : stop // group].contiguous()
        values = part.values
        if part.packed:
            per_word = 32 // part.args.bits
            _on(per_word, start, stop, k, "input", part)
            values = values[:, start // per_word : math.ceil(stop / per_word)]
        else:
            values = values[:, start:stop]
        return replace(part, values=values.contiguous(), scale=scale, zero_point=zero,
                       shape=(part.out_features, stop - start))  # fmt: skip
    raise _refused(part)


def _refused(part: QuantizedWeight) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"tensor parallelism does not split {type(part).__name__} weights yet (it splits "
        f"{' and '.join(SPLIT_METHODS)}); run it with tensor_parallel_size 1"
    )
