"""RMSNorm and residual-add + RMSNorm, one program per row.

The whole row sits in registers (BLOCK = hidden padded to a power of two), so
the fused variant reads x and residual once and writes both outputs in one
pass. Rounding follows the reference (and HF): normalise in fp32, round to the
input dtype, then multiply by the weight in the promoted dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton import arg_checks

MAX_HIDDEN = 65536  # one row per program in registers; Llama-405B is 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (num_rows, hidden)
    residual_ptr,  # (num_rows, hidden), read when HAS_RESIDUAL
    weight_ptr,  # (hidden,)
    out_ptr,  # (num_rows, hidden) in the promoted dtype of weight and the normed input
    residual_out_ptr,  # (num_rows, hidden): x + residual, written when HAS_RESIDUAL
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0)
        # x + residual rounded to its dtype first, exactly like torch's add.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * out_stride + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """t as (num_rows, hidden) with unit column stride; a copy only if no view exists."""
    rows = t.reshape(-1, hidden)
    if hidden > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dim() < 1:
        raise ValueError("x must have a hidden dimension")
    hidden = x.shape[-1]
    arg_checks.check_shape("weight", weight, (hidden,))
    arg_checks.check_dtype("x", x, arg_checks.FLOAT_DTYPES)
    arg_checks.check_dtype("weight", weight, arg_checks.FLOAT_DTYPES)
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        arg_checks.check_shape("residual", residual, tuple(x.shape))
        arg_checks.check_dtype("residual", residual, arg_checks.FLOAT_DTYPES)
        tensors["residual"] = residual
    device = arg_checks.check_device(**tensors)
    arg_checks.check_last_dim_contiguous(weight=weight)
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the kernel limit {MAX_HIDDEN}")

    normed_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, normed_dtype), device=device)
    residual_out = None
    if residual is not None:
        residual_out = torch.empty(x.shape, dtype=normed_dtype, device=device)
    if x.numel() == 0:
        return out, residual_out

    x_rows = _rows(x, hidden)
    residual_rows = _rows(residual, hidden) if residual is not None else x_rows
    out_rows = out.view(-1, hidden)
    residual_out_rows = residual_out.view(-1, hidden) if residual_out is not None else out_rows
    block = arg_checks.pow2(hidden)
    _rms_norm_kernel[(x_rows.shape[0],)](
        x_rows, residual_rows, weight, out_rows, residual_out_rows,
        x_rows.stride(0), residual_rows.stride(0), out_rows.stride(0), residual_out_rows.stride(0),
        hidden, eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=4 if block <= 1024 else (8 if block <= 8192 else 16),
    )  # fmt: skip
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., hidden) -> same shape, ``reference.rms_norm``; hidden <= 65536.

    Any leading shape works (e.g. (num_tokens, num_heads, head_dim) for q/k
    norm); a strided x is read in place when its rows have one stride.
    """
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors, in one pass."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out
