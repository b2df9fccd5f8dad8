"""The CPU path's paged attention: prefill chunks here, decode rows in ``decode.py``.

``CpuAttention`` is one step's attention: what depends only on the batch (the
decode plan) is made when the step begins, and every layer runs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels.batch import AttentionBatch, AttentionKind
from batchgen.kernels.cpu.decode import plan_decode
from batchgen.kernels.cpu.elementwise import store_kv
from batchgen.kernels.cpu.sinks import attention_with_sinks


class CpuAttention:
    def __init__(
        self,
        batch: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kind: AttentionKind,
    ) -> None:
        self.batch = batch
        self.kind = kind
        self.scale = kind.scale
        self.decode_plan = None
        if batch.num_decode_tokens:
            self.decode_plan = plan_decode(
                batch.decode_block_tables, batch.decode_context_lens, k_cache, v_cache,
                window=kind.window, softcap=kind.softcap,
            )  # fmt: skip

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b = self.batch
        store_kv(k, v, k_cache, v_cache, b.slot_mapping)
        nd = b.num_decode_tokens
        parts = []
        if self.decode_plan is not None:
            parts.append(self.decode_plan(q[:nd], k_cache, v_cache, self.scale, sinks))
        if q.shape[0] > nd:
            out = paged_prefill_attention(
                q[nd:], k_cache, v_cache, b.prefill_block_tables, b.prefill_context_lens,
                b.prefill_query_start_loc, self.scale, b.prefill_max_query_len,
                b.prefill_max_context_len, self.kind.window, self.kind.softcap, sinks,
            )  # fmt: skip
            parts.append(out)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def attention_limits(
    num_heads: int, num_kv_heads: int, head_dim: int, kv_shared: bool
) -> str | None:
    """The CPU path takes any attention shape."""
    return None


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length query chunks attending causally to their whole paged context.

    q (num_tokens, num_heads, head_dim) holds each sequence's new tokens back to
    back; query_start_loc (num_seqs + 1,) int32 their offsets; context_lens
    (num_seqs,) int32 the total length (cached + new), the new tokens being the
    last ones, their K/V already stored. With a window, a query at position p
    sees keys p - window < j <= p, and blocks wholly before its chunk's first
    visible key are not read (they may have been handed to another sequence).
    softcap: scores -> softcap * tanh(scores / softcap) before the softmax.
    sinks (num_heads,): gpt-oss's per-head sink logits (``sinks.py``).
    Returns (num_tokens, num_heads, head_dim).
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        first_q = ctx - q_len  # the chunk's first query position
        first_block = 0 if window is None else max(0, first_q - window + 1) // block_size
        base = first_block * block_size  # position of the first key read
        table = block_tables[i, first_block : -(-ctx // block_size)].long()
        keys = k_cache.index_select(0, table).flatten(0, 1)[: ctx - base]  # (ctx - base, Hk, D)
        values = v_cache.index_select(0, table).flatten(0, 1)[: ctx - base]
        mask = None
        if base or ctx != q_len or window is not None or softcap is not None:
            qpos = torch.arange(first_q, ctx, device=q.device)[:, None]
            kpos = torch.arange(base, ctx, device=q.device)[None, :]
            mask = kpos <= qpos  # (q_len, ctx - base)
            if window is not None:
                mask &= kpos > qpos - window
        out[start:end] = _attend(q[start:end], keys, values, mask, scale, softcap, sinks)
    return out


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q (q_len, H, D) over keys/values (n, Hk, D); mask (q_len, n) bool, None: causal
    with q at the last q_len positions. Returns (q_len, H, D)."""
    if sinks is not None and softcap is None:
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, keys, values))
        out = attention_with_sinks(q4, k4, v4, sinks, scale, mask, is_causal=mask is None)
        return out[0].transpose(0, 1)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # (H, q_len, D)
            keys.transpose(0, 1),  # (Hk, n, D)
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)
    # SDPA has no soft-capping: the scores by hand, in fp32 (as transformers' eager path)
    group = q.shape[1] // keys.shape[1]
    k = keys.transpose(0, 1).float().repeat_interleave(group, dim=0)  # (H, n, D)
    v = values.transpose(0, 1).float().repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(1, 2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column per head, no value
        column = sinks.float()[:, None, None].expand(scores.shape[0], scores.shape[1], 1)
        scores = torch.cat((scores, column), dim=-1)
    weights = scores.softmax(dim=-1)[..., : v.shape[1]]
    return torch.matmul(weights, v).transpose(0, 1).to(q.dtype)
