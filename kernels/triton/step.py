"""The Triton path's attention for one step: store K/V, decode rows, then prefill chunks."""

from __future__ import annotations

import torch

from batchgen.kernels.batch import AttentionBatch
from batchgen.kernels.triton.decode_attention import paged_decode_attention
from batchgen.kernels.triton.prefill_attention import paged_prefill_attention
from batchgen.kernels.triton.store_kv import store_kv


class TritonAttention:
    def __init__(
        self,
        batch: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        scale: float,
    ) -> None:
        self.batch = batch
        self.scale = scale

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
        if nd:
            out = paged_decode_attention(
                q[:nd], k_cache, v_cache, b.decode_block_tables, b.decode_context_lens,
                self.scale, b.decode_max_context_len,
            )  # fmt: skip
            parts.append(out)
        if q.shape[0] > nd:
            out = paged_prefill_attention(
                q[nd:], k_cache, v_cache, b.prefill_block_tables, b.prefill_context_lens,
                b.prefill_query_start_loc, self.scale, b.prefill_max_query_len,
                b.prefill_max_context_len,
            )  # fmt: skip
            parts.append(out)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
