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

import itertools
from collections import Counter

import torch
import torch.nn.functional as F

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


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """(num_seqs, num_blocks * block_size, num_kv_heads, head_dim) from each row's blocks."""
    table = block_tables[:, :num_blocks].reshape(-1).long()
    blocks = cache.index_select(0, table)  # (S * nb, bs, Hk, D)
    return blocks.view(block_tables.shape[0], -1, *cache.shape[2:])


def _length_groups(lengths: list[int], max_waste: float = 0.3) -> list[tuple[int, int]]:
    """Row ranges [start, end) of similar length, for rows sorted longest first
    (the scheduler orders decodes so): each range padded to its first row wastes
    at most about max_waste of its work. At most 3 ranges; one when unsorted."""
    if any(a < b for a, b in itertools.pairwise(lengths)):
        return [(0, len(lengths))]
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if (
            i > start
            and len(groups) < 2
            and lengths[start] * (i - start + 1) > (1 + max_waste) * (total + n)
        ):
            groups.append((start, i))
            start, total = i, 0
        total += n
    groups.append((start, len(lengths)))
    return groups


def _decode_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    if max_context_len == 0:  # padding rows only (CUDA-graph batches)
        return torch.zeros_like(q)
    num_blocks = -(-max_context_len // k_cache.shape[1])
    keys = _gather_context(k_cache, block_tables, num_blocks)  # (S, L, Hk, D)
    values = _gather_context(v_cache, block_tables, num_blocks)
    length = keys.shape[1]
    visible = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]  # (S, L)
    # SDPA's fused CPU kernel takes the strided (S, Hk, L, D) views and GQA as is
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # (S, H, 1, D)
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out = out.squeeze(2)
    if bool((context_lens == 0).any()):
        # a padding row attends to nothing: all scores masked, NaN softmax; zeros out
        out = out.masked_fill((context_lens == 0)[:, None, None], 0.0)
    return out


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
    Rows sorted longest first (as the scheduler orders decodes) run in a few
    length groups, so short ones are not padded to the longest.
    """
    if q.shape[0] == 0:
        return torch.empty_like(q)
    lengths = context_lens.tolist()
    rows, shared = _rows_sharing_a_prefix(block_tables, lengths, k_cache.shape[1])
    if not shared:
        return _grouped_decode(q, k_cache, v_cache, block_tables, context_lens, scale, lengths)
    if len(rows) == len(lengths):
        return _cascade_decode(q, k_cache, v_cache, block_tables, context_lens, scale, shared)
    out = torch.empty_like(q)
    taken = set(rows)
    rest = [i for i in range(len(lengths)) if i not in taken]
    idx = torch.tensor(rows, device=q.device)
    out[idx] = _cascade_decode(
        q[idx], k_cache, v_cache, block_tables[idx], context_lens[idx], scale, shared
    )
    idx = torch.tensor(rest, device=q.device)
    out[idx] = _grouped_decode(
        q[idx], k_cache, v_cache, block_tables[idx], context_lens[idx], scale,
        [lengths[i] for i in rest],
    )  # fmt: skip
    return out


def _grouped_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    lengths: list[int],
) -> torch.Tensor:
    groups = _length_groups(lengths)
    if len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, block_tables, context_lens, scale, max(lengths))
    return torch.cat(
        [
            _decode_group(
                q[a:b], k_cache, v_cache, block_tables[a:b], context_lens[a:b], scale, lengths[a]
            )
            for a, b in groups
        ]
    )


def _rows_sharing_a_prefix(
    block_tables: torch.Tensor, lengths: list[int], block_size: int
) -> tuple[list[int], int]:
    """The largest set of rows starting with the same block, and how many
    leading blocks they all share (0: no such set worth a cascade)."""
    firsts = block_tables[:, 0].tolist()
    first, count = Counter(firsts).most_common(1)[0]
    if count < 2:
        return [], 0
    rows = [i for i, f in enumerate(firsts) if f == first]
    tables = block_tables if count == len(firsts) else block_tables[torch.tensor(rows)]
    # every row keeps at least one token of its own after the shared part
    max_blocks = (min(lengths[i] for i in rows) - 1) // block_size
    return rows, _shared_prefix_blocks(tables, max_blocks)


def _shared_prefix_blocks(block_tables: torch.Tensor, max_blocks: int) -> int:
    """How many leading blocks every row shares (a prefix-cache hit common to the batch)."""
    if max_blocks <= 0 or block_tables.shape[0] < 2:
        return 0
    head = block_tables[:, :max_blocks]
    same = (head == head[:1]).all(dim=0)  # (max_blocks,)
    return int(same.cumprod(dim=0).sum())


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, Lq, D) attention and its log-sum-exp (B, H, Lq), for merging partial results."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )
    return out, lse


def _cascade_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    shared: int,
) -> torch.Tensor:
    """Decode when every row starts with the same ``shared`` blocks (a common
    prompt prefix): all queries attend to the prefix once, as one batch, then
    each row to its own suffix; the two softmax parts merge by log-sum-exp.
    Every row has at least one suffix token (shared <= (min context - 1) // block_size)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    prefix_len = shared * block_size
    prefix = block_tables[0, :shared].long()
    kp = k_cache.index_select(0, prefix).view(1, prefix_len, num_kv_heads, head_dim)
    vp = v_cache.index_select(0, prefix).view(1, prefix_len, num_kv_heads, head_dim)
    # every row's query heads of one KV head side by side: (1, Hk, S * group, D)
    qp = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)
    qp = qp.reshape(1, num_kv_heads, num_seqs * group, head_dim)
    out_p, lse_p = _flash_with_lse(qp, kp.transpose(1, 2), vp.transpose(1, 2), None, scale)
    out_p = out_p.view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1)
    lse_p = lse_p.view(num_kv_heads, num_seqs, group).transpose(0, 1)

    suffix_lens = context_lens - prefix_len
    suffix_max = int(suffix_lens.max())
    suffix_blocks = -(-suffix_max // block_size)
    ks = _gather_context(k_cache, block_tables[:, shared:], suffix_blocks)  # (S, Ls, Hk, D)
    vs = _gather_context(v_cache, block_tables[:, shared:], suffix_blocks)
    length = ks.shape[1]
    hidden = torch.arange(length, device=q.device)[None, :] >= suffix_lens[:, None]
    mask = torch.zeros(num_seqs, 1, 1, length, dtype=q.dtype, device=q.device)
    mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
    out_s, lse_s = _flash_with_lse(
        q.view(num_seqs, num_kv_heads, group, head_dim), ks.transpose(1, 2), vs.transpose(1, 2),
        mask, scale,
    )  # fmt: skip

    top = torch.maximum(lse_p, lse_s)
    w_p = torch.exp(lse_p - top).unsqueeze(-1)
    w_s = torch.exp(lse_s - top).unsqueeze(-1)
    out = (out_p * w_p + out_s * w_s) / (w_p + w_s)
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
