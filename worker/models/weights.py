"""A projection's tensors in the layout the forward uses, and its one matmul.

Projections are stored input-major, (in, out), the transpose of HF's
nn.Linear (out, in): MKL's products with few rows, which is what a decode
step is, run 10-30% faster with the weight in that layout than as a
transposed operand. Projections that read the same input are fused into one
matrix (q/k/v, gate/up) when read.

On the CPU, an fp32 or bf16 projection is packed at its first call into
oneDNN's blocked layout (``torch.ops.mkldnn``, what torch.compile's CPU
freezing uses) and multiplied from there: torch.mm copies the whole weight
into the BLAS's panel layout on every call, which at decode's few rows takes
as long as the arithmetic; packed once, the product takes 0.1-0.8x the time
in fp32 (at two threads; at one, a one-row product is faster on torch.mm),
and in bf16 0.24-0.88x torch.mm's bf16 time and 0.25-0.8x the fp32 packed
one (AVX512-BF16, 1-16 rows, one thread or two: ``benchmarks/linear_bench.py``),
where torch.mm in bf16 gained little over fp32. A bf16 product is summed in
fp32 and rounded once (``tests/test_packed_linear.py`` holds it to that
bound; measured, bit for bit torch.mm's).
Below ``PACK_MIN`` elements (measured for each dtype) a oneDNN call's fixed
cost (~15 us) outweighs the copy and torch.mm stays. bf16 is
packed only on a CPU with AVX512-BF16 (which AMX CPUs have too): elsewhere
oneDNN would emulate it, unmeasured. A row's result does not depend on the
other rows of the call nor on the thread count. The dense weight is then
dropped (a ``meta`` tensor keeps its shape): the packed copy is the only
one. Whether to pack is decided once, at the first call; where oneDNN
cannot pack (a torch without it, another CPU) that projection and every
later one stay with torch.mm.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) @ weight (in, out) (+ bias (out,)) -> (rows, out)."""
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


@functools.cache
def _onednn(dtype: torch.dtype) -> bool:
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.bfloat16:  # measured where the CPU multiplies bf16 itself; elsewhere
        # oneDNN would emulate it, unmeasured, so bf16 stays with torch.mm there
        native = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
        return bool(native is not None and native())
    return dtype == torch.float32


# Weights with fewer elements stay with torch.mm: there a oneDNN call's fixed cost outweighs
# torch.mm's copy (fp32 256 x 256: packed 1.4-3x slower; bf16 64 x 64: 3.7x slower at one
# row, while from 128 x 128 up packed bf16 is 0.8-0.95x torch.mm's time)
PACK_MIN = {torch.float32: 1 << 17, torch.bfloat16: 1 << 14}
_refused: list[str] = []  # why oneDNN could not pack a weight, once it could not


def packable(weight: torch.Tensor) -> bool:
    """Whether a projection with this (in, out) weight is packed for oneDNN at first call."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in PACK_MIN
        and weight.numel() >= PACK_MIN[weight.dtype]
        and bool(torch.backends.mkldnn.enabled)
        and _onednn(weight.dtype)
        and not _refused
    )


@dataclass(slots=True)
class Linear:
    weight: torch.Tensor  # (in, out); once packed, a meta tensor of that shape
    bias: torch.Tensor | None = None  # (out,)
    packed: torch.Tensor | None = field(default=None, repr=False, compare=False)
    decided: bool = field(default=False, repr=False, compare=False)  # packed or not, for good

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.decided:
            self.decided = True
            if packable(self.weight):
                self._pack()
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return linear(x, self.weight, self.bias)

    def _pack(self) -> None:
        try:  # oneDNN's layout for (out, in) weights; the row count is only a hint
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.t(), 16)
        except RuntimeError as exc:  # this CPU or build: torch.mm from now on, said once
            _refused.append(str(exc))
            log.warning("oneDNN could not pack a projection (%s); using torch.mm", exc)
            return
        self.packed = packed
        self.weight = self.weight.to("meta")

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]


def fuse(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] = ()) -> Linear:
    """HF (out_i, in) weights (and their biases, all or none) -> one input-major Linear."""
    weight = torch.cat(list(weights)).t().contiguous()
    present = [b for b in biases if b is not None]
    if present and len(present) != len(weights):
        raise ValueError("fused projections must all have a bias or none")
    return Linear(weight, torch.cat(present) if present else None)
