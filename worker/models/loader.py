"""Reads HF safetensors checkpoints (single file or sharded) into a ``TensorStore``."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.jobs.schema.errors import ModelNotLoadable
from batchgen.jobs.schema.model_files import weight_files
from batchgen.worker.models.tensor_store import Lazy, ReadCount, Slice, TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    try:
        return weight_files(path)
    except ModelNotLoadable as exc:
        raise UnsupportedModelError(str(exc)) from None


def read_checkpoint(path: Path, device: torch.device, dtype: torch.dtype) -> TensorStore:
    """The checkpoint's tensors by name, each read from its file when the store hands it
    out: its bytes read straight into a new tensor (no mapping of the file, whose pages
    would stay in the process's memory while mapped); each file's header is read once.
    A tensor taken with a ``Slice`` reads only that slice's bytes (``_read``)."""
    tensors: dict[str, torch.Tensor | Lazy] = {}
    reads = ReadCount()
    for file in checkpoint_files(path):
        for name, entry in _header(file).items():
            tensors[name] = functools.partial(_read, file, name, entry, reads)
    return TensorStore(tensors, path, device, dtype, reads=reads)


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one tensor's bytes lie in its safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # from the file's start
    stop: int


def _header(file: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file holds: an 8-byte little-endian header length, then
    the JSON header (name -> dtype, shape, data_offsets from the end of the header)."""
    from safetensors.torch import _TYPES  # the format's dtype names, as safetensors maps them

    try:
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            file_size = os.fstat(f.fileno()).st_size
        header.pop("__metadata__", None)
        base = 8 + size
        entries = {}
        for name, e in header.items():
            dtype = _TYPES[e["dtype"]]
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"tensor {name!r}: dtype {e['dtype']} (not in this torch)")
            start, stop = (base + o for o in e["data_offsets"])
            entries[name] = _Entry(dtype, tuple(e["shape"]), start, stop)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise UnsupportedModelError(
            f"{file} is not a safetensors file batchgen reads ({exc!r})"
        ) from None
    # every rank refuses a short file at once, not only the one whose slice reaches the cut
    last = max(entries, key=lambda n: entries[n].stop, default=None)
    if last is not None and entries[last].stop > file_size:
        raise UnsupportedModelError(
            f"{file}: {file_size} bytes, but its header places tensor {last!r} up to byte "
            f"{entries[last].stop} (a truncated checkpoint: copy it again)"
        )
    return entries


def _read(
    file: Path, name: str, entry: _Entry, reads: ReadCount, part: Slice | None
) -> torch.Tensor:
    """The tensor, or only ``part`` of it: a slice along dim 0 is one byte range per run; one
    along a later dim is one range per run in each row before it, each read by its own
    ``os.preadv`` straight into its place in the new tensor: faster than reading the whole
    tensor or whole rows and copying the slice out (benchmarks/slice_read_speed.py); copying
    out of a mapping of the file is faster from the page cache, but from a disk it reads
    whole pages (and read-ahead) and holds them mapped while it copies."""
    size = torch.empty((), dtype=entry.dtype).element_size()
    length = entry.stop - entry.start
    if length != math.prod(entry.shape) * size:
        raise UnsupportedModelError(
            f"{file}: tensor {name!r}: its header gives {length} bytes to {entry.shape} "
            f"{entry.dtype} (a damaged checkpoint)"
        )
    shape = entry.shape if part is None else part.shape(entry.shape)
    tensor = torch.empty(shape, dtype=entry.dtype)
    out = tensor.reshape(-1).view(torch.uint8).numpy().data  # a memoryview of its bytes
    ranges = [(0, length)] if part is None else _ranges(entry.shape, size, part)
    done = 0
    with file.open("rb", buffering=0) as f:
        for start, n in ranges:
            got = _pread(f.fileno(), out[done : done + n], entry.start + start, reads)
            if got < n:
                raise UnsupportedModelError(
                    f"{file}: tensor {name!r} of {length} bytes for {entry.shape} "
                    f"{entry.dtype} ends after {start + got} (a truncated or damaged checkpoint)"
                )
            done += n
    return tensor


def _ranges(shape: tuple[int, ...], size: int, part: Slice) -> list[tuple[int, int]]:
    """The (offset in the tensor, length) byte ranges of ``part``, in the order it is laid
    out; ranges that meet are merged."""
    inner = math.prod(shape[part.dim + 1 :]) * size  # bytes per index along part.dim
    row = shape[part.dim] * inner  # bytes per index of the dims before it
    ranges: list[tuple[int, int]] = []
    for r in range(math.prod(shape[: part.dim])):
        for start, stop in part.runs:
            offset, n = r * row + start * inner, (stop - start) * inner
            if n and ranges and sum(ranges[-1]) == offset:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
            elif n:
                ranges.append((offset, n))
    return ranges


def _pread(fd: int, out: memoryview, offset: int, reads: ReadCount) -> int:
    """Reads into ``out`` from ``offset`` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        reads.calls += 1
        reads.bytes += n
        if n == 0:
            break
        got += n
    return got
