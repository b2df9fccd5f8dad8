"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import gc
import math
import mmap

import torch

from batchgen.worker.models import ModelShape

# CPU has no "free device memory" to read; without an explicit size we take this.
DEFAULT_CPU_KV_BYTES = 1 << 30


def bytes_per_block(config: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for block_size tokens (MLA: the one latent tensor)."""
    elem = torch.empty((), dtype=dtype).element_size()
    tensors = 1 if config.kv_shared else 2
    return tensors * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def num_blocks_for_budget(
    config: ModelShape,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_bytes: int | None,
    gpu_memory_utilization: float,
) -> int:
    """How many blocks fit: an explicit byte budget, or on CUDA a fraction of
    the device memory left after the weights (and a margin for activations)."""
    per_block = bytes_per_block(config, block_size, dtype)
    if kv_cache_bytes is None:
        if device.type == "cuda":
            kv_cache_bytes = cuda_kv_budget(device, gpu_memory_utilization)
        else:
            kv_cache_bytes = DEFAULT_CPU_KV_BYTES
    return kv_cache_bytes // per_block


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """``kv_budget`` of the device as it is once PyTorch has handed back what it
    caches: blocks freed since loading (temporaries, a peer's weights) would
    otherwise count as used, though the KV pool could have them."""
    gc.collect()  # tensors kept alive only by reference cycles
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return kv_budget(total, free, gpu_memory_utilization)


# logits and activations of a full step come out of the same memory
STEP_MARGIN_BYTES = 2 << 30


def kv_budget(total: int, free: int, gpu_memory_utilization: float) -> int:
    """Bytes for the KV pool: ``gpu_memory_utilization`` of the device, less all
    it has in use (``total - free``: other processes, this one's CUDA context,
    and the memory PyTorch holds, its live tensors with the weights), less the
    step's margin; never below 0."""
    in_use = total - free
    return max(int(total * gpu_memory_utilization) - in_use - STEP_MARGIN_BYTES, 0)


def allocate_kv_cache(
    config: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One allocation; per layer a (k, v) pair of (num_blocks, block_size, num_kv_heads, head_dim).

    MLA (``config.kv_shared``): k and v are one tensor, the latent, which
    attention reads as keys and as values.
    """
    tensors = 1 if config.kv_shared else 2
    shape = (tensors, config.num_layers, num_blocks, block_size, config.num_kv_heads,
             config.head_dim)  # fmt: skip
    if device.type == "cpu":
        cache = _lazy_zeros(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    if config.kv_shared:
        return [(cache[0, i],) * 2 for i in range(config.num_layers)]
    return [(cache[0, i], cache[1, i]) for i in range(config.num_layers)]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros backed by an anonymous mmap: the OS hands out zero pages on first
    touch, so a large pool costs memory only for the blocks actually used."""
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(size, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
