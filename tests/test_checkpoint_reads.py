"""The checkpoint reader (worker/models/loader.py): each tensor read from its file when
taken, bit for bit what safetensors itself reads, and a damaged file refused in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.loader import read_checkpoint

CPU = torch.device("cpu")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=g)
    return {
        "f32": x, "f16": x.half(), "bf16": x.bfloat16(), "fp8": x.to(torch.float8_e4m3fn),
        "i32": torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g),
        "i64": torch.arange(6, dtype=torch.int64) * 2**40, "u8": torch.arange(9, dtype=torch.uint8),
        "bool": x > 0, "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3),
    }  # fmt: skip


def test_every_tensor_reads_as_safetensors_reads_it(tmp_path: Path) -> None:
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    store = read_checkpoint(tmp_path, CPU, torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            want, got = f.get_tensor(name), store.take_stored(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.dim() else (
                got.item() == want.item()
            ), name  # fmt: skip
    store.check_all_taken("none")


def test_a_truncated_file_is_refused_when_its_header_is_read(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4), "b": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    file = tmp_path / "model.safetensors"
    whole = file.read_bytes()
    file.write_bytes(whole[:-8])
    with pytest.raises(UnsupportedModelError, match=re.escape(
        f"{file}: {len(whole) - 8} bytes, but its header places tensor 'b' up to byte "
        f"{len(whole)} (a truncated checkpoint: copy it again)")):  # fmt: skip
        read_checkpoint(tmp_path, CPU, torch.float32)


def test_a_file_cut_after_its_header_was_read_is_refused_naming_the_tensor(tmp_path: Path):
    save_file({"a": torch.zeros(4), "b": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    file = tmp_path / "model.safetensors"
    store = read_checkpoint(tmp_path, CPU, torch.float32)  # headers only: no tensor read yet
    file.write_bytes(file.read_bytes()[:-8])
    assert torch.equal(store.take("a"), torch.zeros(4))
    with pytest.raises(UnsupportedModelError, match=r"tensor 'b' of 256 bytes .* ends after "
                       r"248 \(a truncated or damaged checkpoint\)"):  # fmt: skip
        store.take("b")


def test_a_file_that_is_not_safetensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(UnsupportedModelError, match="is not a safetensors file batchgen reads"):
        read_checkpoint(tmp_path, CPU, torch.float32)
