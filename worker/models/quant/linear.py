"""A projection whose weights stay quantized: the product dequantizes them a tile at a time.

``QuantizedLinear`` is a ``Linear`` (x (rows, in) @ W (in, out) + bias) whose W
is never materialised whole: each call walks the output features in tiles of
at most ``TILE_BYTES`` of fp32, dequantizes one tile of each part into
(in, tile) and multiplies it (``weights.linear``), so the extra memory is one
tile. A tile's columns come out bit for bit as the same columns of
dequantize-then-matmul would (a column of an fp32 product does not depend on
the other columns of its call). Fused projections (q/k/v, gate/up) keep one
``QuantizedWeight`` per module, in the checkpoint's layout, and write their
outputs side by side (on the Triton ops they are joined, below).

W8A8 int8 (int8 weights with a scale per output channel, int8 activations with a
dynamic scale per token) skips the dequantizing on the CPU: each row of the input
is quantized to int8 exactly as the dequantizing path quantizes it, multiplied by
the stored int8 weights with ``torch._int_mm`` (int32 sums, exact), and each sum
scaled by its token's and its channel's scale. It equals the dequantizing path up
to the fp32 rounding of those products (``int8`` says which path a projection runs).

On the Triton ops (``kernels/ops.py``'s ``QuantGemms``, given at load) a projection
whose every part has a GEMM for its format (``QuantizedWeight.kernel``: block FP8,
4-bit GPTQ, AWQ and compressed-tensors pack-quantized) runs those GEMMs on the
stored tensors instead (``kernels`` says so), its bias added after: the weights
stay as stored on the device and no tile is dequantized in torch. A fused
projection's parts are first joined along the outputs into one weight of their
format (``worker/models/quant/fused_parts.py``), so it is one GEMM launch with no
``torch.cat``; parts whose layouts do not join (act-order parts with different
``g_idx``, differing groups, a width that cuts a packed word or a scale block) keep
one GEMM each and their outputs are concatenated. Block FP8 then
quantizes the input per token and group of bk columns (w8a8, as DeepSeek-V3 runs
it); the 4-bit GEMMs form the weights ``dequantize`` forms, (q - z) * s in the
scales' dtype, so only the order of their sums differs from the CPU path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from batchgen.worker.models.quant.compressed_tensors import ActivationArgs
from batchgen.worker.models.quant.fused_parts import join_outputs
from batchgen.worker.models.quant.scheme import QuantizedWeight
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.models.weights import Linear, linear
from batchgen.worker.worker_errors import UnsupportedModelError

if TYPE_CHECKING:
    from batchgen.kernels.ops import QuantGemms
    from batchgen.worker.models.dense_weights import CheckpointLayout

TILE_BYTES = 4 << 20  # one dequantized tile, fp32


@dataclass(slots=True)
class QuantizedLinear(Linear):
    """``weight`` is a meta tensor of the (in, out) shape; ``parts`` hold the data."""

    parts: tuple[QuantizedWeight, ...] = field(default=(), repr=False)
    # the modules fused here, as the checkpoint names them (refusals); a part each, or one
    # part joined from them all (on the Triton ops, below)
    names: tuple[str, ...] = ()
    # the input's dynamic quantize-dequantize (W8A8 schemes); None: the input as it is
    quantize_input: Callable[[torch.Tensor], torch.Tensor] | None = None
    # W8A8 int8: each part's int8 (out, in) weights and fp32 scale, multiplied in int32 on
    # the CPU; None: the dequantizing product (decided from parts and quantize_input)
    int8: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # the op set's GEMMs for quantized weights (the Triton ops); None: the CPU path's products
    gemms: QuantGemms | None = field(default=None, repr=False, compare=False)
    # each part's GEMM, bound to its stored tensors, where every part has one and the input
    # goes in as it is, the parts first joined into one where their layouts allow
    # (worker/models/quant/fused_parts.py); None: the products above (decided from parts
    # and gemms)
    kernels: tuple[Callable[[torch.Tensor], torch.Tensor], ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.gemms is not None and self.quantize_input is None:
            found = [p.kernel(self.gemms) for p in self.parts]
            if self.parts and all(k is not None for k in found):
                joined = join_outputs(self.parts) if len(self.parts) > 1 else None
                one = None if joined is None else joined.kernel(self.gemms)
                if joined is not None and one is not None:  # one GEMM, no torch.cat
                    self.parts = (joined,)
                    found = [one]
                self.kernels = tuple(k for k in found if k is not None)
        act = self.quantize_input
        if not (isinstance(act, ActivationArgs) and act.kind == "int"):
            return
        rows = [p.int8_rows() for p in self.parts]
        if self.parts and all(r is not None for r in rows):
            self.int8 = tuple(r for r in rows if r is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            outs = [product(x) for product in self.kernels]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
            return out if self.bias is None else out.add_(self.bias)
        if self.int8 is not None and x.device.type == "cpu":
            return self._int8_product(x)
        if self.quantize_input is not None:
            x = self.quantize_input(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        column = 0
        for part in self.parts:
            for start, stop in _tiles(part):
                tile = part.dequantize(start, stop).to(x.dtype).t().contiguous()
                bias = None if self.bias is None else self.bias[column + start : column + stop]
                out[:, column + start : column + stop] = linear(x, tile, bias)
            column += part.out_features
        return out

    def _int8_product(self, x: torch.Tensor) -> torch.Tensor:
        assert self.int8 is not None and isinstance(self.quantize_input, ActivationArgs)
        rounded, token_scale = self.quantize_input.quantize(x)
        q = rounded.to(torch.int8)
        token_scale = token_scale.float()
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        column = 0
        for weight, channel_scale in self.int8:
            sums = torch._int_mm(q, weight.t())  # (rows, out) int32
            part = sums.float().mul_(token_scale).mul_(channel_scale)
            stop = column + weight.shape[0]
            if self.bias is not None:
                part.add_(self.bias[column:stop])
            out[:, column:stop] = part
            column = stop
        return out

    def dequantized(self) -> torch.Tensor:
        """The whole (in, out) weight in fp32: what the product equals (tests, references)."""
        return torch.cat([p.dequantize(0, p.out_features) for p in self.parts]).t().contiguous()

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return sum(p.nbytes for p in self.parts) + bias


def _tiles(part: QuantizedWeight) -> list[tuple[int, int]]:
    step = part.column_step
    per_tile = max(step, TILE_BYTES // (4 * part.in_features) // step * step)
    return [
        (start, min(start + per_tile, part.out_features))
        for start in range(0, part.out_features, per_tile)
    ]


def read_quantized(
    store: TensorStore, names: list[str], bias: bool, layout: CheckpointLayout
) -> QuantizedLinear | None:
    """The projections ``names`` (fused in that order) as one ``QuantizedLinear`` when the
    checkpoint quantizes them; None when it has no quantization or leaves them plain."""
    scheme = store.quantization
    if scheme is None:
        return None
    quantized = [scheme.quantizes(name) for name in names]
    if not any(quantized):
        return None
    if not all(quantized):
        raise UnsupportedModelError(
            f"quantization_config ({scheme.method}) quantizes some of {', '.join(names)} but "
            "not all; batchgen reads fused projections all quantized or all plain"
        )
    if layout.transposed or layout.qkv_per_head or layout.rope_interleaved:
        raise UnsupportedModelError(
            f"{scheme.method} quantization is not supported for a family whose projections "
            "are reordered or transposed at load"
        )
    parts = tuple(scheme.read(store, name) for name in names)
    in_features = {p.in_features for p in parts}
    if len(in_features) != 1:
        raise UnsupportedModelError(f"fused projections {names} differ in input features")
    activations = {scheme.activation(store, name) for name in names}
    if len(activations) != 1:
        raise UnsupportedModelError(f"fused projections {names} quantize their input differently")
    biases = store.take_all(f"{n}.bias" for n in names) if bias else []
    out = sum(p.out_features for p in parts)
    shape = torch.empty(in_features.pop(), out, device="meta")
    return QuantizedLinear(
        shape, torch.cat(biases) if biases else None, decided=True, parts=parts,
        quantize_input=activations.pop(), names=tuple(names), gemms=store.gemms,
    )  # fmt: skip
