"""The CPU path's attention for one step: the decode plan is made once, every layer runs it."""

from __future__ import annotations

import torch

from batchgen.kernels.batch import AttentionBatch
from batchgen.kernels.reference import paged_prefill_attention, store_kv
from batchgen.kernels.reference_decode import plan_decode, run_decode


class CpuAttention:
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
        self.decode_plan = None
        if batch.num_decode_tokens:
            self.decode_plan = plan_decode(
                batch.decode_block_tables,
                batch.decode_context_lens,
                k_cache.shape[1],
                k_cache.dtype,
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
            parts.append(run_decode(self.decode_plan, q[:nd], k_cache, v_cache, self.scale))
        if q.shape[0] > nd:
            out = paged_prefill_attention(
                q[nd:], k_cache, v_cache, b.prefill_block_tables, b.prefill_context_lens,
                b.prefill_query_start_loc, self.scale, b.prefill_max_query_len,
                b.prefill_max_context_len,
            )  # fmt: skip
            parts.append(out)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
