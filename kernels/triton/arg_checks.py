"""Host-side argument checks shared by the Triton wrappers.

Wrong caller input raises ``ValueError`` (shapes, sizes, devices) or
``TypeError`` (dtypes) with a message that names the argument; the kernels
themselves only ``assert`` internal invariants.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

# Read once at import, like triton.jit does: kernels defined while
# TRITON_INTERPRET=1 run on the CPU through the interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): tl.arange sizes must be powers of two."""
    return max(triton.next_power_of_2(n), minimum)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast tl.dot operands to fp32.

    The Triton 3.x interpreter's tl.dot multiplies bfloat16 operands as their
    raw uint16 bits (it stores bf16 as np.uint16), and float8 ones as uint8,
    so under TRITON_INTERPRET bf16 and fp8 dots are done in fp32. Compiled
    kernels keep bf16 and fp8 tensor-core dots.
    """
    return INTERPRETED and dtype in (torch.bfloat16, torch.float8_e4m3fn)


def check_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, which Triton can run on; returns it."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{name}={d}" for name, d in devices.items())
        raise ValueError(f"tensors must share one device, got {listed}")
    if first.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"Triton ops need CUDA tensors, got {first}; use the reference ops on this device "
            "(select_ops) or set TRITON_INTERPRET=1 before importing them to run the interpreter"
        )
    return first


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must be one of {names}, got {t.dtype}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name}={d}" for name, d in dtypes.items())
        raise TypeError(f"dtypes must match, got {listed}")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")


def check_dim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Kernels vectorise along the last dimension; other strides are passed in."""
    for name, t in tensors.items():
        if t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dimension (stride {t.stride()})"
            )


@dataclass(frozen=True, slots=True)
class PagedAttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    group: int  # query heads per KV head
    device: torch.device


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    *,
    max_head_dim: int,
    max_group: int,
    **index_tensors: torch.Tensor,
) -> PagedAttentionShape:
    """What the decode and prefill wrappers both require of their arguments.

    q (num_tokens, num_heads, head_dim); caches (num_blocks, block_size,
    num_kv_heads, head_dim) sharing q's float dtype and strides; block_tables
    (num_seqs, max_blocks_per_seq), context_lens (num_seqs,) and any other
    ``index_tensors`` int32/int64; max_context_len within the tables' capacity.
    """
    check_dim("q", q, 3, "(num_tokens, num_heads, head_dim)")
    check_dim("k_cache", k_cache, 4, "(num_blocks, block_size, num_kv_heads, head_dim)")
    check_dim("block_tables", block_tables, 2, "(num_seqs, max_blocks_per_seq)")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("context_lens", context_lens, (block_tables.shape[0],))
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    if head_dim > max_head_dim or group > max_group:
        raise ValueError(
            f"head_dim {head_dim} (max {max_head_dim}) or heads per KV head {group} "
            f"(max {max_group}) beyond the kernel's limits"
        )
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_context_len {max_context_len} exceeds the block table's capacity "
            f"{block_tables.shape[1]} blocks x {block_size}"
        )
    check_dtype("q", q, FLOAT_DTYPES)
    check_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    index = {"block_tables": block_tables, "context_lens": context_lens, **index_tensors}
    for name, t in index.items():
        check_dtype(name, t, INDEX_DTYPES)
    device = check_device(q=q, k_cache=k_cache, v_cache=v_cache, **index)
    check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache, **index)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache strides differ: {k_cache.stride()} vs {v_cache.stride()}"
        )
    return PagedAttentionShape(num_heads, num_kv_heads, head_dim, block_size, group, device)


def check_sinks(sinks: torch.Tensor | None, shape: PagedAttentionShape) -> None:
    """Sink logits: (num_heads,) float, contiguous, on the attention's device."""
    if sinks is None:
        return
    check_shape("sinks", sinks, (shape.num_heads,))
    check_dtype("sinks", sinks, FLOAT_DTYPES)
    if sinks.device != shape.device:
        raise ValueError(f"sinks must be on {shape.device}, got {sinks.device}")
    if sinks.stride(0) != 1:
        raise ValueError("sinks must be contiguous")
