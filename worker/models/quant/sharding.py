"""A quantized projection's shard on one tensor-parallel rank, cut on its format's groups.

Column-parallel keeps a run of each fused module's output features, row-parallel
a run of its input features (``worker/models/tensor_parallel.py`` says which
projection is which). The weights stay quantized, in the checkpoint's layout,
and every kept value keeps its own scale, so a cut must fall on the format's
boundaries: FP8 block-wise (``Fp8BlockWeight``) on its (bn, bk) blocks;
compressed-tensors (``CompressedWeight``: W4A16/W8A16 packed, W8A8, FP8) on
its scale groups along the input, on whole int32 words of packed values, and
on whole words of a packed zero point down the outputs; AWQ (``AwqWeight``) on
whole words of eight outputs and on its groups along the input; GPTQ
(``GptqWeight``) on whole words of outputs (its zero points) and of inputs (its
values). GPTQ names each input's group (``g_idx``), so its input cut needs no
group boundary: a shard keeps the groups its inputs read (with act-order,
``desc_act``, that is most of them, as vLLM keeps them all) and its inputs'
``g_idx`` renumbered into them. A cut inside a group or a word is refused,
naming the module and the sizes.

Routed experts are cut the same way, inside each expert (``experts_shard``): each
expert's gate and up keep a run of their output features, its down the same run of its
input features. Block FP8 experts (``Fp8BlockExpertWeights``, stacked) are cut expert by
expert as the dense ``Fp8BlockWeight`` is, gate and up each on its own block grid; GPTQ,
AWQ and compressed-tensors experts (``QuantizedExpertWeights``) hold one
``QuantizedWeight`` per projection, each cut as a dense part is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from batchgen.kernels.experts import Fp8BlockExpertWeights, QuantizedExpertWeights
from batchgen.worker.models.quant.awq import AwqWeight
from batchgen.worker.models.quant.compressed_tensors import CompressedWeight
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from batchgen.worker.models.quant.gptq import GptqWeight
from batchgen.worker.models.quant.linear import QuantizedLinear
from batchgen.worker.models.quant.scheme import QuantizedWeight
from batchgen.worker.worker_errors import UnsupportedModelError

SPLIT_METHODS = (
    "fp8",
    "compressed-tensors",
    "gptq",
    "awq",
)  # the quant_methods whose weights are cut here


def column_shard(layer: QuantizedLinear, index: torch.Tensor) -> QuantizedLinear:
    """The output features ``index`` (increasing), each run of consecutive ones cut from
    the part that holds it: a part joined from several modules (q/k/v on the Triton ops,
    ``worker/models/quant/fused_parts.py``) yields a run per module, joined again as the
    shard is built."""
    parts, offset = [], 0
    for i, part in enumerate(layer.parts):
        n = part.out_features
        mine = index[(index >= offset) & (index < offset + n)] - offset
        if mine.numel():
            breaks = (torch.nonzero(mine.diff() != 1).flatten() + 1).tolist()
            for run in torch.tensor_split(mine, breaks):
                start, stop = int(run[0]), int(run[-1]) + 1
                parts.append(_outputs(_Cut(_name(layer, i), part, start, stop, n, "output")))
        offset += n
    bias = None if layer.bias is None else layer.bias.index_select(0, index).contiguous()
    shape = torch.empty(layer.weight.shape[0], index.numel(), device="meta")
    return replace(layer, weight=shape, bias=bias, parts=tuple(parts))


def row_shard(layer: QuantizedLinear, start: int, stop: int, keep_bias: bool) -> QuantizedLinear:
    """The input features [start, stop); the bias only where ``keep_bias`` (added once)."""
    shape = torch.empty(stop - start, layer.weight.shape[1], device="meta")
    parts = tuple(
        _inputs(_Cut(_name(layer, i), part, start, stop, part.in_features, "input"))
        for i, part in enumerate(layer.parts)
    )
    return replace(layer, weight=shape, bias=layer.bias if keep_bias else None, parts=parts)


def experts_shard(
    experts: Fp8BlockExpertWeights | QuantizedExpertWeights,
    span: Callable[[int], tuple[int, int]],
) -> Fp8BlockExpertWeights | QuantizedExpertWeights:
    """Every expert's intermediate features [start, stop) = ``span(inter)``: gate's and up's
    outputs, down's inputs."""
    start, stop = span(_expert(experts, 0)[0].out_features)
    cuts = []
    for e in range(experts.num_experts):
        gate, up, down = _expert(experts, e)
        names = experts.names[e] if experts.names else _unnamed(e)
        cuts.append((_outputs(_Cut(names[0], gate, start, stop, gate.out_features, "output")),
                     _outputs(_Cut(names[1], up, start, stop, up.out_features, "output")),
                     _inputs(_Cut(names[2], down, start, stop, down.in_features, "input"))))  # fmt: skip
    gates, ups, downs = (tuple(p) for p in zip(*cuts))
    if isinstance(experts, QuantizedExpertWeights):
        return replace(experts, gate=gates, up=ups, down=downs)
    gate_up = [torch.cat((_fp8(g).weight, _fp8(u).weight)) for g, u in zip(gates, ups)]
    scale = [torch.cat((_fp8(g).scale_inv, _fp8(u).scale_inv)) for g, u in zip(gates, ups)]
    return replace(experts, gate_up=torch.stack(gate_up), gate_up_scale_inv=torch.stack(scale),
                   down=torch.stack([_fp8(d).weight for d in downs]),
                   down_scale_inv=torch.stack([_fp8(d).scale_inv for d in downs]))  # fmt: skip


def _expert(
    experts: Fp8BlockExpertWeights | QuantizedExpertWeights, e: int
) -> tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight]:
    """Expert e's gate, up and down; a stacked FP8 expert's each on its own block grid."""
    if isinstance(experts, QuantizedExpertWeights):
        return experts.gate[e], experts.up[e], experts.down[e]  # type: ignore[return-value]
    inter, rows = experts.gate_up.shape[1] // 2, experts.gate_up_scale_inv.shape[1] // 2
    weight, scale, block = experts.gate_up[e], experts.gate_up_scale_inv[e], experts.block
    return (Fp8BlockWeight(weight[:inter], scale[:rows], block),
            Fp8BlockWeight(weight[inter:], scale[rows:], block),
            Fp8BlockWeight(experts.down[e], experts.down_scale_inv[e], block))  # fmt: skip


def _unnamed(e: int) -> tuple[str, str, str]:
    return (f"expert {e}'s gate", f"expert {e}'s up", f"expert {e}'s down")


def _fp8(part: QuantizedWeight) -> Fp8BlockWeight:
    assert isinstance(part, Fp8BlockWeight)
    return part


def _name(layer: QuantizedLinear, i: int) -> str:
    if len(layer.parts) == 1 and len(layer.names) > 1:  # one part joined from them all
        return " + ".join(layer.names)
    return layer.names[i] if i < len(layer.names) else "a projection"


@dataclass(frozen=True, slots=True)
class _Cut:
    """One part's features [start, stop) of ``size``, along its ``axis`` (output or input)."""

    name: str  # the module (model.layers.0.self_attn.o_proj)
    part: QuantizedWeight
    start: int
    stop: int
    size: int
    axis: str

    def on(self, step: int, unit: str) -> None:
        """Refuse a cut inside the part's ``unit`` (of ``step`` features each)."""
        if self.start % step or (self.stop % step and self.stop != self.size):
            raise UnsupportedModelError(
                f"tensor parallelism would cut {self.name} ({type(self.part).__name__}) at "
                f"{self.axis} features [{self.start}, {self.stop}) of {self.size}, inside its "
                f"{unit}; use a tensor_parallel_size whose shards hold whole ones"
            )

    def words(self, bits: int) -> slice:
        """The int32 words that pack this cut's features ``bits`` wide (whole words only)."""
        per_word = 32 // bits
        self.on(per_word, f"int32 words of {per_word} packed values")
        return slice(self.start // per_word, math.ceil(self.stop / per_word))

    def groups(self, group: int) -> slice:
        """The groups of ``group`` features this cut holds (whole groups only)."""
        self.on(group, f"groups of {group}")
        return slice(self.start // group, math.ceil(self.stop / group))


def _outputs(cut: _Cut) -> QuantizedWeight:
    part, start, stop = cut.part, cut.start, cut.stop
    if isinstance(part, Fp8BlockWeight):
        scale = part.scale_inv[cut.groups(part.block[0])]
        return replace(part, weight=part.weight[start:stop].contiguous(),
                       scale_inv=scale.contiguous())  # fmt: skip
    if isinstance(part, CompressedWeight):
        zero = part.zero_point
        if zero is not None and part.packed:  # packed down the rows: whole words
            zero = zero[cut.words(part.args.bits)].contiguous()
        elif zero is not None:
            zero = zero[start:stop].contiguous()
        scale = part.scale if part.scale.numel() == 1 else part.scale[start:stop].contiguous()
        return replace(part, values=part.values[start:stop].contiguous(), scale=scale,
                       zero_point=zero, shape=(stop - start, part.in_features))  # fmt: skip
    if isinstance(part, GptqWeight):  # zero points packed along the outputs
        zeros = part.qzeros[:, cut.words(part.bits)]
        return replace(part, qweight=part.qweight[:, start:stop].contiguous(),
                       qzeros=zeros.contiguous(), scales=part.scales[:, start:stop].contiguous())  # fmt: skip
    if isinstance(part, AwqWeight):  # values and zero points packed along the outputs
        words = cut.words(4)
        return replace(part, qweight=part.qweight[:, words].contiguous(),
                       qzeros=part.qzeros[:, words].contiguous(),
                       scales=part.scales[:, start:stop].contiguous())  # fmt: skip
    raise _refused(part)


def _inputs(cut: _Cut) -> QuantizedWeight:
    part, start, stop = cut.part, cut.start, cut.stop
    if isinstance(part, Fp8BlockWeight):
        scale = part.scale_inv[:, cut.groups(part.block[1])]
        return replace(part, weight=part.weight[:, start:stop].contiguous(),
                       scale_inv=scale.contiguous())  # fmt: skip
    if isinstance(part, CompressedWeight):
        scale, zero = part.scale, part.zero_point
        if scale.dim() == 2 and scale.shape[1] > 1:  # groups along the input
            groups = cut.groups(part.in_features // scale.shape[1])
            scale = scale[:, groups].contiguous()
            zero = None if zero is None else zero[:, groups].contiguous()
        values = part.values
        values = values[:, cut.words(part.args.bits)] if part.packed else values[:, start:stop]
        return replace(part, values=values.contiguous(), scale=scale, zero_point=zero,
                       shape=(part.out_features, stop - start))  # fmt: skip
    if isinstance(part, GptqWeight):  # values packed along the inputs; g_idx names each group
        g_idx = part.g_idx[start:stop]
        first, last = int(g_idx.min()), int(g_idx.max()) + 1
        return replace(part, qweight=part.qweight[cut.words(part.bits)].contiguous(),
                       qzeros=part.qzeros[first:last].contiguous(),
                       scales=part.scales[first:last].contiguous(),
                       g_idx=(g_idx - first).to(part.g_idx.dtype).contiguous())  # fmt: skip
    if isinstance(part, AwqWeight):
        groups = cut.groups(part.group_size)
        return replace(part, qweight=part.qweight[start:stop].contiguous(),
                       qzeros=part.qzeros[groups].contiguous(),
                       scales=part.scales[groups].contiguous())  # fmt: skip
    raise _refused(part)


def _refused(part: QuantizedWeight) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"tensor parallelism does not split {type(part).__name__} weights yet (it splits "
        f"{', '.join(SPLIT_METHODS)} weights); run it with tensor_parallel_size 1"
    )
