"""A fused projection's quantized parts (q/k/v, gate/up) joined into one stored tensor set.

On the Triton ops each quantized part runs its format's GEMM
(``worker/models/quant/linear.py``); joined along the outputs, a fused projection
is one GEMM launch whose output needs no ``torch.cat``, as a dense fused projection
is one matrix (``worker/models/weights.py``'s ``fuse``). The join is exact: every
value keeps its scale, zero point and group, so the joined weight dequantizes to
the parts' weights side by side, bit for bit. Parts join where their formats'
layouts concatenate along the outputs:

- GPTQ (``GptqWeight``): qweight packs the inputs down each column, so its columns
  concatenate; so do the scales' columns and the zero points' words of 32 / bits
  outputs where every part but the last holds whole words, the parts have the same
  groups and the same ``g_idx`` (act-order parts quantized with different
  permutations keep a GEMM each), bits and zero-point offset.
- AWQ (``AwqWeight``): qweight and qzeros pack eight outputs a word, and every
  part's width is whole words; the same group size.
- compressed-tensors (``CompressedWeight``): rows are outputs (values packed along
  the input); a scale per output row with the same groups along the input; an
  asymmetric zero point packed down the outputs needs whole words in every part but
  the last. A scale per tensor (one value per part) does not join.
- block FP8 (``Fp8BlockWeight``): rows are outputs, the scale grid's rows blocks of
  bn of them: every part but the last a whole number of blocks, the same block (a
  checkpoint with one scale per tensor has a block per part: equal heights join).

Parts that differ otherwise (group sizes, ``g_idx``, dtypes, a width that cuts a
word or a block) return None: the projection keeps one GEMM per part and writes
their outputs side by side, as before. Projections whose input is quantized first
(W8A8, static FP8 input scales) have no GEMM and are not joined.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.worker.models.quant.awq import AwqWeight
from batchgen.worker.models.quant.compressed_tensors import CompressedWeight
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from batchgen.worker.models.quant.gptq import GptqWeight
from batchgen.worker.models.quant.scheme import QuantizedWeight


def join_outputs(parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
    """The parts side by side along the outputs as one weight of their format (its output
    features the parts' in order); None where their layouts do not join (see above)."""
    first = parts[0] if parts else None
    if len(parts) < 2 or any(type(p) is not type(first) for p in parts):
        return None
    stored = {tuple(t.dtype for t in p.tensors()) for p in parts}
    if len(stored) != 1 or len({p.in_features for p in parts}) != 1:
        return None
    if isinstance(first, GptqWeight):
        return _gptq([p for p in parts if isinstance(p, GptqWeight)])
    if isinstance(first, AwqWeight):
        return _awq([p for p in parts if isinstance(p, AwqWeight)])
    if isinstance(first, CompressedWeight):
        return _compressed([p for p in parts if isinstance(p, CompressedWeight)])
    if isinstance(first, Fp8BlockWeight):
        return _fp8_block([p for p in parts if isinstance(p, Fp8BlockWeight)])
    return None


def _whole(parts: Sequence[QuantizedWeight], step: int) -> bool:
    """Every part but the last ends on a boundary of ``step`` outputs (a word, a block)."""
    return all(p.out_features % step == 0 for p in parts[:-1])


def _gptq(parts: list[GptqWeight]) -> GptqWeight | None:
    first = parts[0]
    same = all(
        (p.bits, p.zero_offset, p.scales.shape[0]) == (first.bits, first.zero_offset,
                                                       first.scales.shape[0])
        and torch.equal(p.g_idx, first.g_idx)
        for p in parts
    )  # fmt: skip
    if not same or not _whole(parts, 32 // first.bits):
        return None
    return GptqWeight(
        torch.cat([p.qweight for p in parts], dim=1), torch.cat([p.qzeros for p in parts], dim=1),
        torch.cat([p.scales for p in parts], dim=1), first.g_idx, first.bits, first.zero_offset,
    )  # fmt: skip


def _awq(parts: list[AwqWeight]) -> AwqWeight | None:
    if len({p.group_size for p in parts}) != 1 or not _whole(parts, 8):
        return None
    return AwqWeight(
        torch.cat([p.qweight for p in parts], dim=1), torch.cat([p.qzeros for p in parts], dim=1),
        torch.cat([p.scales for p in parts], dim=1), parts[0].group_size,
    )  # fmt: skip


def _compressed(parts: list[CompressedWeight]) -> CompressedWeight | None:
    first = parts[0]
    groups = {p.scale.shape[1] if p.scale.dim() == 2 else None for p in parts}
    if None in groups or len(groups) != 1:
        return None
    if any(p.scale.shape[0] != p.out_features for p in parts):  # one scale per tensor
        return None
    if any((p.args, p.packed, p.zero_point is None) != (first.args, first.packed,
                                                        first.zero_point is None)
           for p in parts):  # fmt: skip
        return None
    zero = None
    if first.zero_point is not None:
        if first.packed and not _whole(parts, 32 // first.args.bits):
            return None  # a word of zero points would hold two parts' outputs
        zero = torch.cat([p.zero_point for p in parts if p.zero_point is not None])
    return CompressedWeight(
        torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), zero,
        first.args, (sum(p.out_features for p in parts), first.in_features), first.packed,
    )  # fmt: skip


def _fp8_block(parts: list[Fp8BlockWeight]) -> Fp8BlockWeight | None:
    block = parts[0].block
    if any(p.block != block for p in parts) or not _whole(parts, block[0]):
        return None
    weight = torch.cat([p.weight for p in parts])
    return Fp8BlockWeight(weight, torch.cat([p.scale_inv for p in parts]), block)
