"""RMSNorm and LayerNorm as the config says, and the residual add folded into them.

The decoder keeps the residual stream apart from each block's output and adds
them where the next norm reads them (``add_then_norm``): for RMSNorm that is
one fused op of the kernel set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.kernels.ops import KernelOps
from batchgen.worker.models.model_config import NormKind, NormSpec


@dataclass(slots=True)
class Norm:
    spec: NormSpec
    weight: torch.Tensor  # (dim,), or (heads, head_dim) for per-head q/k norms
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """Normalises the last dimension of x (any leading shape)."""
        eps = self.spec.eps
        if self.spec.kind is NormKind.RMS:
            if self.weight.dim() == 1 and x.dim() == 2:
                return ops.rms_norm(x, self.weight, eps)
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            return self.weight * xf.to(x.dtype)
        if self.weight.dim() == 1:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, eps)
        # one weight per head: normalise each head, then scale it by its own weight
        out = F.layer_norm(x.float(), x.shape[-1:], None, None, eps) * self.weight.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

    def add_then_norm(
        self, delta: torch.Tensor | None, residual: torch.Tensor, ops: KernelOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta), residual + delta); delta None adds nothing."""
        if delta is None:
            return self(residual, ops), residual
        if self.spec.kind is NormKind.RMS:
            return ops.fused_add_rms_norm(delta, residual, self.weight, self.spec.eps)
        residual = residual + delta
        return self(residual, ops), residual


def add_then_norm(
    norm: Norm | None, delta: torch.Tensor | None, residual: torch.Tensor, ops: KernelOps
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Norm.add_then_norm``, where no norm (OLMo 2 has none before its blocks) gives the sum."""
    if norm is not None:
        return norm.add_then_norm(delta, residual, ops)
    summed = residual if delta is None else residual + delta
    return summed, summed
