"""Self-attention: fused q/k/v projection, optional q/k norms, (partial) rotary, paged attention.

A layer's attention is anything with this ``__call__`` (``AttentionBlock``);
MLA (DeepSeek), which caches a compressed latent, plugs in there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from batchgen.kernels.batch import StepAttention
from batchgen.kernels.ops import KernelOps
from batchgen.worker.models.layers.norms import Norm
from batchgen.worker.models.layers.rope import RopeTable
from batchgen.worker.models.model_config import AttentionSpec, QKNormScope
from batchgen.worker.models.weights import Linear


class AttentionBlock(Protocol):
    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RopeTable | None,
        attend: StepAttention,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ops: KernelOps,
    ) -> torch.Tensor:
        """(num_tokens, hidden) -> (num_tokens, hidden); stores this step's K/V in the cache."""
        ...


@dataclass(slots=True)
class SelfAttention:
    spec: AttentionSpec
    qkv: Linear  # (hidden, (num_heads + 2 * num_kv_heads) * head_dim)
    o: Linear  # (num_heads * head_dim, hidden)
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    sinks: torch.Tensor | None = None  # (num_heads,) fp32 sink logits (gpt-oss)

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RopeTable | None,
        attend: StepAttention,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ops: KernelOps,
    ) -> torch.Tensor:
        s = self.spec
        num_tokens, dim = x.shape[0], s.head_dim
        q_size, kv_size = s.num_heads * dim, s.num_kv_heads * dim
        q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None and s.qk_norm is not None:
            if s.qk_norm.scope is QKNormScope.ALL:
                q, k = self.q_norm(q, ops), self.k_norm(k, ops)
            else:
                q = _per_head(self.q_norm, q.reshape(num_tokens, s.num_heads, dim), ops)
                k = _per_head(self.k_norm, k.reshape(num_tokens, s.num_kv_heads, dim), ops)
        q = q.reshape(num_tokens, s.num_heads, dim)
        k = k.reshape(num_tokens, s.num_kv_heads, dim)
        v = v.reshape(num_tokens, s.num_kv_heads, dim)
        if rope is not None:
            q, k = _rotate(q, k, positions, rope, s.rotary_dim, ops)
        out = attend(q, k, v, k_cache, v_cache, self.sinks)
        return self.o(out.reshape(num_tokens, q_size))


def _per_head(norm: Norm, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
    """x (T, H, D): each head normalised; a (D,) weight shared, or (H, D), one per head."""
    if norm.weight.dim() == 1:
        return norm(x.reshape(-1, x.shape[-1]), ops).view_as(x)
    return norm(x, ops)


def _rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeTable,
    rotary_dim: int,
    ops: KernelOps,
) -> tuple[torch.Tensor, torch.Tensor]:
    if rotary_dim == q.shape[-1]:
        return ops.apply_rotary(q, k, positions, rope.cos, rope.sin)
    # partial rotary: the leading rotary_dim channels turn, the rest pass through
    q_rot, k_rot = ops.apply_rotary(
        q[..., :rotary_dim], k[..., :rotary_dim], positions, rope.cos, rope.sin
    )
    return (
        torch.cat((q_rot, q[..., rotary_dim:]), dim=-1),
        torch.cat((k_rot, k[..., rotary_dim:]), dim=-1),
    )
