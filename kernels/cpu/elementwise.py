"""The CPU path's RMSNorm (with and without the residual add), rotary,
SiLU-and-multiply and K/V store.

Same signatures and semantics as ``reference.py``, which they fall back to
for what the C functions of ``native.py`` do not take (neither fp32 nor
bf16, dtypes mixed, rows without one stride, no compiler). In bf16 they
compute in fp32 and round to bf16 where ``reference.py`` rounds: the rotary,
the K/V store and the residual add give its bits; the norm and SiLU may
differ from it by one bf16 step (their fp32 sum of squares and e^x are not
torch's to the last bit; ``kernels/cpu/elementwise.c`` says where). At decode batch sizes a layer's norms,
rotary, activation and cache writes are twenty torch ops or more, each
costing its dispatch; here each is one call.
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.kernels import reference
from batchgen.kernels.cpu.native import Native, load

# the dtypes the C functions take, and their names' suffix
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _kernel(native: Native, name: str, dtype: torch.dtype) -> Any:
    """The C function ``name`` for ``dtype`` (a key of ``_SUFFIX``)."""
    return getattr(native, f"{name}_{_SUFFIX[dtype]}")


def _rows(*tensors: torch.Tensor) -> bool:
    """2-D CPU tensors of one dtype the C functions take, each row contiguous."""
    return all(
        t.dtype == tensors[0].dtype in _SUFFIX
        and t.device.type == "cpu"
        and t.dim() == 2
        and t.stride(1) == 1
        for t in tensors
    )


def _native_for(weight: torch.Tensor, *rows: torch.Tensor) -> Native | None:
    ok = _rows(*rows) and weight.dtype == rows[0].dtype and weight.is_contiguous()
    return load() if ok and weight.shape == rows[0].shape[1:] else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    native = _native_for(weight, x)
    if native is None:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    _kernel(native, "add_rms_norm", x.dtype)(
        x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), None,
        x.shape[0], x.shape[1], eps,
    )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    native = _native_for(weight, x, residual) if x.shape == residual.shape else None
    if native is None:
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out, summed = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    _kernel(native, "add_rms_norm", x.dtype)(
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
        out.data_ptr(), summed.data_ptr(), x.shape[0], x.shape[1], eps,
    )  # fmt: skip
    return out, summed


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # q and k fp32 or bf16; the tables fp32 (the bf16 engine's too)
    ok = q.dtype == k.dtype in _SUFFIX and cos_cache.dtype == sin_cache.dtype == torch.float32
    native = load() if ok and _rotary_layout(q, k, positions, cos_cache, sin_cache) else None
    if native is None:
        return reference.apply_rotary(q, k, positions, cos_cache, sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty(num_tokens, num_heads + num_kv_heads, head_dim, dtype=q.dtype)
    status = _kernel(native, "rotary", q.dtype)(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0],
        out.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim,
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"rotary: a position is outside the table's {cos_cache.shape[0]} rows")
    return out[:, :num_heads], out[:, num_heads:]


def _rotary_layout(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> bool:
    head_dim = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dim() == k.dim() == 3
        and q.shape[0] == k.shape[0] == positions.shape[0]
        and k.shape[2] == head_dim
        and head_dim % 2 == 0
        and q.stride(2) == k.stride(2) == 1
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape == (cos.shape[0], head_dim // 2)
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    native = load() if _rows(x) and x.shape[1] % 2 == 0 else None
    if native is None:
        return reference.silu_and_mul(x)
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inter, dtype=x.dtype)
    _kernel(native, "silu_and_mul", x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), rows, inter)
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if not _kv_layout(key, value, k_cache, v_cache, slot_mapping) or (native := load()) is None:
        return reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    slots = k_cache.shape[0] * k_cache.shape[1]
    status = _kernel(native, "store_kv", key.dtype)(
        key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
        value.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        num_tokens, num_kv_heads, head_dim, slots,
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"store_kv: a slot is outside the cache's {slots} slots")


def _kv_layout(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> bool:
    """CPU key/value (T, Hk, D), unit stride in D, and contiguous caches (blocks,
    block_size, Hk, D), all fp32 or all bf16; int64 contiguous slots (T,)."""
    return (
        key.dtype in _SUFFIX
        and all(t.dtype == key.dtype and t.device.type == "cpu" for t in (value, k_cache, v_cache))
        and key.dim() == 3
        and key.shape == value.shape
        and key.stride(2) == value.stride(2) == 1
        and k_cache.dim() == 4
        and k_cache.shape == v_cache.shape
        and k_cache.shape[2:] == key.shape[1:]
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and slots.shape == (key.shape[0],)
    )
