"""The gated activations of an MLP's gate/up output x (..., 2 * inter), gate half first.

- silu_and_mul: silu(gate) * up. silu is computed in fp32 and rounded to the
  input dtype before the multiply, matching torch's F.silu(gate) * up.
- clamped_swiglu: gpt-oss's experts (``reference.clamped_swiglu``), in fp32.

Grid (num_rows, cdiv(inter, BLOCK)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import arg_checks

BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (num_rows, 2 * inter): gate then up
    out_ptr,  # (num_rows, inter)
    x_stride,
    out_stride,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + inter + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _clamped_swiglu_kernel(
    x_ptr,  # (num_rows, 2 * inter): gate then up
    out_ptr,  # (num_rows, inter)
    x_stride,
    out_stride,
    inter,
    alpha,
    limit,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    glu = gate * tl.sigmoid(gate * alpha)
    tl.store(
        out_ptr + row * out_stride + offs,
        ((up + 1.0) * glu).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2 * inter) -> (..., inter), ``reference.silu_and_mul``; no size limit."""
    rows, out, out_rows = _rows(x)
    if out.numel():
        grid = (rows.shape[0], triton.cdiv(out_rows.shape[1], BLOCK))
        _silu_and_mul_kernel[grid](
            rows, out_rows, rows.stride(0), out_rows.stride(0), out_rows.shape[1], BLOCK=BLOCK
        )
    return out


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """x (..., 2 * inter) -> (..., inter), ``reference.clamped_swiglu``; no size limit."""
    rows, out, out_rows = _rows(x)
    if out.numel():
        grid = (rows.shape[0], triton.cdiv(out_rows.shape[1], BLOCK))
        _clamped_swiglu_kernel[grid](
            rows, out_rows, rows.stride(0), out_rows.stride(0), out_rows.shape[1],
            float(alpha), float(limit), BLOCK=BLOCK,
        )  # fmt: skip
    return out


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks x; returns x as (num_rows, 2 * inter) rows, the output and its (num_rows, inter) view."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must end in an even dimension (gate and up), got {tuple(x.shape)}")
    arg_checks.check_dtype("x", x, arg_checks.FLOAT_DTYPES)
    device = arg_checks.check_device(x=x)
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=device)
    rows = x.reshape(-1, 2 * inter)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows, out, out.view(-1, inter)
