"""How fast a rank reads its columns of a row-parallel weight, four ways.

    python benchmarks/slice_read_speed.py                 # a 7B's down_proj: (4096, 11008) bf16
    python benchmarks/slice_read_speed.py --rows 1024 --cols 2816

Writes one (rows, cols) tensor to a safetensors file and times reading rank 0 of 2's
columns [0, cols / 2): ``preadv per row`` (worker/models/loader.py's slice read: one
read per row, straight into the new tensor), ``whole, then slice`` (every byte read,
then the columns copied out), ``rows in chunks`` (64 rows at a time into one buffer,
then their columns copied: every byte read, one chunk held) and ``mmap, strided copy``
(the file mapped and the columns copied out of the mapping, then unmapped). The file
was just written, so every way reads from the page cache: this times the system calls
and copies, not a disk. Best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import mmap
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from batchgen.worker.models.loader import read_checkpoint
from batchgen.worker.models.tensor_store import Slice


def _data_start(file: Path) -> int:
    with file.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=11008)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows, cols, half = args.rows, args.cols, args.cols // 2
    whole = torch.randn(rows, cols).bfloat16()
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "model.safetensors"
        save_file({"w": whole}, str(file))
        want = whole[:, :half].contiguous()
        start, row = _data_start(file), cols * 2

        def sliced() -> torch.Tensor:
            return read_checkpoint(Path(tmp), torch.device("cpu"), torch.bfloat16).take(
                "w", part=Slice(1, ((0, half),))
            )

        def whole_then_slice() -> torch.Tensor:
            store = read_checkpoint(Path(tmp), torch.device("cpu"), torch.bfloat16)
            return store.take("w")[:, :half].contiguous()

        def chunks(step: int = 64) -> torch.Tensor:
            out = torch.empty(rows, half, dtype=torch.bfloat16)
            buf = torch.empty(step, cols, dtype=torch.bfloat16)
            with file.open("rb", buffering=0) as f:
                for r in range(0, rows, step):
                    n = min(step, rows - r)
                    f.seek(start + r * row)
                    f.readinto(buf[:n].view(torch.uint8).numpy().data.cast("B"))
                    out[r : r + n] = buf[:n, :half]
            return out

        def mapped() -> torch.Tensor:
            with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                data = np.frombuffer(m, dtype=np.uint16, count=rows * cols, offset=start)
                out = torch.from_numpy(data.reshape(rows, cols)[:, :half].copy())
                del data
            return out.view(torch.bfloat16)

        ways: dict[str, Callable[[], torch.Tensor]] = {
            "preadv per row": sliced,
            "whole, then slice": whole_then_slice,
            "rows in chunks": chunks,
            "mmap, strided copy": mapped,
        }
        print(f"({rows}, {cols}) bf16, columns [0, {half}): {rows * half * 2 >> 20} MiB of "
              f"{rows * cols * 2 >> 20}")  # fmt: skip
        for name, way in ways.items():
            best = float("inf")
            for _ in range(args.repeats):
                began = time.perf_counter()
                got = way()
                best = min(best, time.perf_counter() - began)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
            print(f"{name:>20}: {best * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
