"""Host arrays onto the device: on CUDA through pinned buffers, one queued copy per
dtype; on a CPU device the host tensors themselves (no staging)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from batchgen.worker.engine.runner.host_staging import stage, to_device

CPU = torch.device("cpu")


def _step_arrays() -> list[np.ndarray]:
    return [
        np.arange(12, dtype=np.int32).reshape(3, 4),  # a block table
        np.array([5, 9, 2], dtype=np.int32),
        np.zeros((0, 1), dtype=np.int32),  # no prefill rows
        np.array([0, 3], dtype=np.int64),  # another dtype: converted
    ]


def test_on_a_cpu_device_the_host_arrays_are_the_tensors():
    arrays = _step_arrays()
    tensors = stage(arrays, torch.int32, CPU, packed=False)
    for a, t in zip(arrays[:3], tensors[:3]):
        assert t.data_ptr() == a.ctypes.data or a.size == 0  # no copy at all
    assert [t.tolist() for t in tensors] == [a.tolist() for a in arrays]
    values = torch.tensor([1.5, 2.5])
    assert to_device(values, torch.float32, CPU) is values


def test_packed_staging_gives_the_same_tensors_from_one_buffer():
    arrays = _step_arrays()
    tensors = stage(arrays, torch.int32, CPU, packed=True)
    assert [t.tolist() for t in tensors] == [a.tolist() for a in arrays]
    assert [tuple(t.shape) for t in tensors] == [a.shape for a in arrays]
    assert all(t.dtype == torch.int32 and t.is_contiguous() for t in tensors)
    # views of one buffer, back to back
    assert tensors[1].data_ptr() == tensors[0].data_ptr() + 12 * 4


@pytest.mark.gpu
def test_on_cuda_staging_is_queued_without_a_sync():
    cuda = torch.device("cuda")
    arrays = _step_arrays()
    stage(arrays, torch.int32, cuda, packed=True)  # pinned blocks allocated once
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tensors = stage(arrays, torch.int32, cuda, packed=True)
            values = to_device([0.5, 1.5], torch.float32, cuda)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    assert [t.tolist() for t in tensors] == [a.tolist() for a in arrays]
    assert values.tolist() == [0.5, 1.5]
