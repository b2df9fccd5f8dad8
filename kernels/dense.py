"""Paged attention the plainest way: the oracle every attention kernel is tested against.

Each sequence's K/V is read through its block table into a dense (context,
num_kv_heads, head_dim) tensor, and its queries, the last ones of that
context, attend causally with a plain softmax in fp32. Same signatures as the
kernels; slow, and right by inspection.
"""

from __future__ import annotations

import torch


def sequence_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first context_len tokens of one sequence: (context_len, num_kv_heads, head_dim)."""
    return cache[block_table.long()].flatten(0, 1)[:context_len]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (q_len, H, D) at the last q_len positions of k/v (ctx, Hk, D), causal -> (q_len, H, D).

    window: a query at position p sees only keys p - window < j <= p; softcap:
    scores become softcap * tanh(scores / softcap) before the softmax."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads  # query head h reads KV head h // group
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    position = torch.arange(ctx - q_len, ctx, device=q.device)
    keys = torch.arange(ctx, device=q.device)[None, :]
    visible = keys <= position[:, None]  # (q_len, ctx)
    if window is not None:
        visible &= keys > position[:, None] - window
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence; a context of 0 (a padding row) gives zeros."""
    out = torch.zeros_like(q)
    for i, ctx in enumerate(context_lens.tolist()):
        if ctx:
            k = sequence_kv(k_cache, block_tables[i], ctx)
            v = sequence_kv(v_cache, block_tables[i], ctx)
            out[i : i + 1] = attend(q[i : i + 1], k, v, scale, window, softcap)
    return out


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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Sequence i's queries are rows query_start_loc[i]:query_start_loc[i + 1] of q."""
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        first, end = starts[i], starts[i + 1]
        if end > first:
            k = sequence_kv(k_cache, block_tables[i], ctx)
            v = sequence_kv(v_cache, block_tables[i], ctx)
            out[first:end] = attend(q[first:end], k, v, scale, window, softcap)
    return out
