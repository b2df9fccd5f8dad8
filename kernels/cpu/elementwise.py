"""The CPU path's RMSNorm (with and without the residual add) and rotary.

Same signatures and semantics as ``reference.py``, which they fall back to
for what the C functions of ``cpu_native.py`` do not take (not fp32, rows
without one stride, no compiler). At decode batch sizes a layer's norms and
rotary are a dozen torch ops or more, each costing its dispatch; here each is
one call.
"""

from __future__ import annotations

import torch

from batchgen.kernels import reference
from batchgen.kernels.cpu.native import Native, load


def _fp32_rows(*tensors: torch.Tensor) -> bool:
    """2-D fp32 CPU tensors, each row contiguous."""
    return all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1
        for t in tensors
    )


def _native_for(weight: torch.Tensor, *rows: torch.Tensor) -> Native | None:
    ok = _fp32_rows(*rows) and weight.dtype == torch.float32 and weight.is_contiguous()
    return load() if ok and weight.shape == rows[0].shape[1:] else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    native = _native_for(weight, x)
    if native is None:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty(x.shape)
    native.add_rms_norm_f32(
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
    out, summed = torch.empty(x.shape), torch.empty(x.shape)
    native.add_rms_norm_f32(
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
    fp32 = all(t.dtype == torch.float32 for t in (q, k, cos_cache, sin_cache))
    native = load() if fp32 and _rotary_layout(q, k, positions, cos_cache, sin_cache) else None
    if native is None:
        return reference.apply_rotary(q, k, positions, cos_cache, sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty(num_tokens, num_heads + num_kv_heads, head_dim)
    status = native.rotary_f32(
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
