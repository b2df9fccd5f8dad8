"""A checkpoint's tensors, handed out by name; every one must be taken.

Tensors are read from their files when taken (``Lazy``), so a load holds the
model it builds, not the checkpoint besides. A tensor-parallel rank's store
also carries ``slices`` (worker/models/tensor_shard.py's ``RankSlices``): a
reader that asks for a split tensor's ``Slice`` gets only this rank's part of
it, and only that part's bytes are read from the file
(worker/models/loader.py; ``reads`` counts them); and ``cut_layer``: the
readers (worker/models/dense_weights.py) hand each layer to it as soon as it
is read, to cut what was read whole (worker/models/tensor_parallel.py).

A family's weight mapping takes the tensors it uses; whatever is left when
the model is built is a tensor the model would ignore (an o_proj bias, a norm
the code never applies), and the load is refused naming it
(``check_all_taken``), since transformers would use it and give other tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchgen.worker.worker_errors import UnsupportedModelError

if TYPE_CHECKING:
    from batchgen.kernels.ops import QuantGemms
    from batchgen.worker.models.quant import Scheme
    from batchgen.worker.models.tensor_shard import RankSlices

# Buffers older checkpoints carry that transformers itself skips on load
# (``_keys_to_ignore_on_load_unexpected``): precomputed rotary frequencies.
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")


@dataclass(frozen=True, slots=True)
class Slice:
    """Part of a tensor: the runs [start, stop) of indices along ``dim``, side by side."""

    dim: int
    runs: tuple[tuple[int, int], ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        size = sum(stop - start for start, stop in self.runs)
        return shape[: self.dim] + (size,) + shape[self.dim + 1 :]

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of a tensor already in memory."""
        parts = [tensor.narrow(self.dim, start, stop - start) for start, stop in self.runs]
        return torch.cat(parts, self.dim)

    def transposed(self) -> Slice:
        """The same part of a 2-D tensor stored the other way round, (in, out)."""
        return Slice(1 - self.dim, self.runs)


@dataclass(slots=True)
class ReadCount:
    """What a checkpoint's reads took from its files (tests and benchmarks read it)."""

    bytes: int = 0
    calls: int = 0  # read system calls


# reads one tensor from its file when called: the whole of it, or the Slice given
Lazy = Callable[[Slice | None], torch.Tensor]


class TensorStore:
    def __init__(
        self,
        tensors: dict[str, torch.Tensor | Lazy],
        path: Path,
        device: torch.device,
        dtype: torch.dtype,
        quantization: Scheme | None = None,
        reads: ReadCount | None = None,
    ) -> None:
        self._tensors = {k: v for k, v in tensors.items() if not IGNORED.match(k)}
        self.path = path
        self.device = device
        self.dtype = dtype
        self.quantization = quantization  # how the checkpoint's quantized projections are stored
        self.reads = reads or ReadCount()  # what the lazy tensors' reads took from the files
        self.slices: RankSlices | None = None  # a rank's part of each split tensor
        self.cut_layer: Callable[[Any], Any] | None = None  # a rank's cut of each layer read
        # the op set's GEMMs for quantized projections (the Triton ops); None: the CPU path's
        self.gemms: QuantGemms | None = None

    def _pop(self, name: str, part: Slice | None = None) -> torch.Tensor:
        tensor = self._tensors.pop(name, None)
        if tensor is None:
            raise UnsupportedModelError(f"checkpoint {self.path} lacks tensor {name!r}")
        if isinstance(tensor, torch.Tensor):
            return tensor if part is None else part.of(tensor)
        return tensor(part)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str, *, float32: bool = False, part: Slice | None = None) -> torch.Tensor:
        """The tensor (only ``part`` of it, if given), on the model's device and dtype (fp32
        if asked, to compute with before rounding); it counts as used."""
        tensor = self._pop(name, part)
        return tensor.to(device=self.device, dtype=torch.float32 if float32 else self.dtype)

    def take_stored(self, name: str) -> torch.Tensor:
        """The tensor on the model's device in the dtype the checkpoint stores it in
        (quantized weights and their scales); it counts as used."""
        return self._pop(name).to(device=self.device)

    def take_all(self, names: Iterable[str]) -> list[torch.Tensor]:
        return [self.take(name) for name in names]

    def take_if(self, present: bool, name: str) -> torch.Tensor | None:
        """The tensor when the config says it exists, else None (and it must not exist)."""
        return self.take(name) if present else None

    def discard(self, name: str) -> None:
        """Drops a buffer the family knows transformers skips too (GPT-2's mask)."""
        self._tensors.pop(name, None)

    def discard_prefix(self, prefix: str) -> None:
        """Drops every tensor under ``prefix``: modules transformers' forward skips too
        (DeepSeek-V3's multi-token prediction layers)."""
        for name in [n for n in self._tensors if n.startswith(prefix)]:
            del self._tensors[name]

    def refuse(self, name: str, why: str) -> None:
        raise UnsupportedModelError(f"checkpoint {self.path}: tensor {name!r}: {why}")

    def check_all_taken(self, family: str) -> None:
        left = sorted(self._tensors)
        if left:
            shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
            raise UnsupportedModelError(
                f"checkpoint {self.path} holds tensor(s) batchgen's native {family} "
                f"implementation would not use: {shown}; refusing to run it rather than "
                "give tokens that differ from transformers'"
            )
