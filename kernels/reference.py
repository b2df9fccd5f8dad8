"""Pure-torch versions of every op the model calls.

They are the CPU path of the engine (so they are vectorised, not merely
readable) and the oracle the Triton kernels are tested against. Each Triton
wrapper in this package has the same signature as its function here;
paged decode attention, the one op with a plan of its own, lives in
``reference_decode.py``.

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

from batchgen.kernels.reference_decode import paged_decode_attention

__all__ = [
    "PAD_SLOT_ID",
    "apply_rotary",
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
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


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_context_len: int,
) -> torch.Tensor:
    """Variable-length query chunks attending causally to their whole paged context.

    q (num_tokens, num_heads, head_dim) holds each sequence's new tokens back to
    back; query_start_loc (num_seqs + 1,) int32 their offsets; context_lens
    (num_seqs,) int32 the total length (cached + new), the new tokens being the
    last ones, their K/V already stored. Returns (num_tokens, num_heads, head_dim).
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-ctx // block_size)
        table = block_tables[i, :num_blocks].long()
        keys = k_cache.index_select(0, table).flatten(0, 1)[:ctx]  # (ctx, Hk, D)
        values = v_cache.index_select(0, table).flatten(0, 1)[:ctx]
        if ctx == q_len:
            mask, causal = None, True  # no cached context: plain causal attention
        else:
            # query t sits at position ctx - q_len + t and sees keys 0..that position
            qpos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # (q_len, ctx)
            causal = False
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # (H, q_len, D)
            keys.transpose(0, 1),  # (Hk, ctx, D)
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn.transpose(0, 1)
    return out
