"""The CPU path's paged attention: prefill chunks here, decode rows in ``cpu_decode.py``.

``CpuAttention`` is one step's attention: what depends only on the batch (the
decode plan) is made when the step begins, and every layer runs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels.batch import AttentionBatch, AttentionKind
from batchgen.kernels.cpu.decode import plan_decode
from batchgen.kernels.reference import store_kv


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
                batch.decode_block_tables, batch.decode_context_lens, k_cache, v_cache
            )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        b = self.batch
        store_kv(k, v, k_cache, v_cache, b.slot_mapping)
        nd = b.num_decode_tokens
        parts = []
        if self.decode_plan is not None:
            parts.append(self.decode_plan(q[:nd], k_cache, v_cache, self.scale))
        if q.shape[0] > nd:
            out = paged_prefill_attention(
                q[nd:], k_cache, v_cache, b.prefill_block_tables, b.prefill_context_lens,
                b.prefill_query_start_loc, self.scale, b.prefill_max_query_len,
                b.prefill_max_context_len,
            )  # fmt: skip
            parts.append(out)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


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
