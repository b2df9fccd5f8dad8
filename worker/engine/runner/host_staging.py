"""Host values onto the device without making the host wait.

A copy to a CUDA device from ordinary (pageable) memory is not asynchronous,
``non_blocking`` or not: CUDA stages it through a driver buffer and the host
waits for it, and ``torch.tensor(values, device=cuda)`` also waits for all the
work queued before it. From pinned (page-locked) memory the copy is queued on
the stream and the host goes on at once. PyTorch's pinned-memory allocator
caches its blocks and reuses one only after the copy that read it has
finished, so taking a fresh pinned tensor per step allocates once and then
reuses, and a buffer is never overwritten while its copy is in flight.

On a CPU device there is nothing to copy: the host tensor is the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Values = torch.Tensor | np.ndarray | Sequence[int] | Sequence[float]


def to_device(values: Values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``; on CUDA the copy is queued, not waited for."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def stage(
    arrays: Sequence[np.ndarray], dtype: torch.dtype, device: torch.device, packed: bool
) -> list[torch.Tensor]:
    """Each array as a ``dtype`` tensor of its shape on ``device``.

    ``packed`` (on CUDA): all of them in one pinned buffer and one queued copy,
    returned as views of the one device tensor. Otherwise each array is taken
    as it is (on a CPU device: no copy where the array has the dtype already).
    """
    if not packed:
        return [torch.as_tensor(a, dtype=dtype).to(device) for a in arrays]
    sizes = [a.size for a in arrays]
    host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
    flat = host.numpy()
    start = 0
    for a, n in zip(arrays, sizes):
        flat[start : start + n] = a.reshape(-1)
        start += n
    on_device = host.to(device, non_blocking=True)
    return [part.view(a.shape) for part, a in zip(torch.split(on_device, sizes), arrays)]
