"""Pure-torch versions of the model's elementwise ops and of the KV-cache store.

They are the CPU path of the engine and, being a line or two of torch each,
the oracle the Triton kernels are tested against; each Triton wrapper has the
same signature as its function here. Attention is elsewhere: the oracle in
``dense.py``, the CPU path in ``cpu/attention.py`` and ``cpu/decode.py``.

Layouts (shared with the Triton kernels):
- hidden states are flat over the batch: (num_tokens, ...);
- a layer's KV cache is (num_blocks, block_size, num_kv_heads, head_dim);
- block_tables (num_seqs, max_blocks_per_seq) int32; a row's unused tail may
  hold any block id of that sequence (never read past context_lens);
- slot_mapping (num_tokens,) int64: block_id * block_size + offset, or
  PAD_SLOT_ID for padding tokens, whose K/V are not stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "PAD_SLOT_ID",
    "apply_rotary",
    "clamped_swiglu",
    "fused_add_rms_norm",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]

# Slot id of padding tokens (CUDA-graph batches are padded); never a real slot.
PAD_SLOT_ID = -1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (num_tokens, hidden) -> (num_tokens, hidden); in fp32 like HF, then weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, same math
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); both (num_tokens, hidden)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, 2 * inter) -> silu(x[:, :inter]) * x[:, inter:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation; x (num_tokens, 2 * inter), gate then up halves.

    gate is clamped to <= limit and up to [-limit, limit]; then
    (up + 1) * gate * sigmoid(alpha * gate), in transformers' order of operations.
    """
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-layout rotary embedding (rotate the two halves of head_dim).

    q (num_tokens, num_heads, head_dim), k (num_tokens, num_kv_heads, head_dim),
    positions (num_tokens,) int64, cos_cache/sin_cache (max_positions, head_dim // 2)
    fp32 (any rope scaling is already in them). Returns new (q, k), each in its
    input dtype.
    """
    num_heads = q.shape[1]
    cos = cos_cache[positions].unsqueeze(1)  # (num_tokens, 1, head_dim // 2)
    sin = sin_cache[positions].unsqueeze(1)
    qk = torch.cat((q, k), dim=1).float()  # rotate both with one set of ops
    x1, x2 = qk.chunk(2, dim=-1)
    out = torch.cat(
        (torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin)), dim=-1
    )
    return out[:, :num_heads].to(q.dtype), out[:, num_heads:].to(k.dtype)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key/value (num_tokens, num_kv_heads, head_dim) into their cache slots."""
    num_kv_heads, head_dim = key.shape[1:]
    if (slot_mapping == PAD_SLOT_ID).any():
        keep = slot_mapping != PAD_SLOT_ID
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)
