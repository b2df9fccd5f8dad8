"""Pure-torch versions of every op the model calls.

They are the CPU path of the engine (so they are vectorised, not merely
readable) and the oracle the Triton kernels are tested against. Each Triton
wrapper in this package has the same signature as its function here.

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

# Slot id of padding tokens (CUDA-graph batches are padded); never a real slot.
PAD_SLOT_ID = -1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (num_tokens, hidden) -> (num_tokens, hidden); computed in fp32 like HF."""
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
    cos = cos_cache[positions].unsqueeze(1)  # (num_tokens, 1, head_dim // 2)
    sin = sin_cache[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


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


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """(num_seqs, num_blocks * block_size, num_kv_heads, head_dim) from each row's blocks."""
    blocks = cache[block_tables[:, :num_blocks].long()]  # (S, nb, bs, Hk, D)
    return blocks.flatten(1, 2)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """One query token per sequence over its paged context.

    q (num_seqs, num_heads, head_dim); context_lens (num_seqs,) int32 count the
    current token, whose K/V are already stored (0 for a padding row, whose
    output is zeros). Returns (num_seqs, num_heads, head_dim).
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-max_context_len // block_size)
    keys = _gather_context(k_cache, block_tables, num_blocks)  # (S, L, Hk, D)
    values = _gather_context(v_cache, block_tables, num_blocks)
    # (S, Hk, group, D) @ (S, Hk, D, L) -> (S, Hk, group, L)
    qg = q.view(num_seqs, num_kv_heads, group, head_dim).float()
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1).float()) * scale
    length = keys.shape[1]
    pad = torch.arange(length, device=q.device)[None, :] >= context_lens[:, None]  # (S, L)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A padding row (context 0, as in padded CUDA-graph batches) has only -inf
    # scores and a NaN softmax; it attends to nothing and yields zeros.
    probs.masked_fill_((context_lens == 0)[:, None, None, None], 0.0)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3).float())  # (S, Hk, group, D)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


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
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-ctx // block_size)
        table = block_tables[i, :num_blocks].long()
        keys = k_cache[table].flatten(0, 1)[:ctx]  # (ctx, Hk, D)
        values = v_cache[table].flatten(0, 1)[:ctx]
        # query t sits at position ctx - q_len + t and sees keys 0..that position
        qpos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # (q_len, ctx)
        qh = q[start:end].transpose(0, 1).float()  # (H, q_len, D)
        kh = keys.transpose(0, 1).float().repeat_interleave(group, dim=0)  # (H, ctx, D)
        vh = values.transpose(0, 1).float().repeat_interleave(group, dim=0)
        attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[start:end] = attn.transpose(0, 1).to(q.dtype)
    return out
