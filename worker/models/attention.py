"""Paged attention over a step's flat batch: decode rows first, then prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels import KernelOps


@dataclass(slots=True)
class AttentionBatch:
    """Where each token's K/V goes and what each sequence attends to.

    The first ``num_decode_tokens`` rows are single-token decodes (one per
    sequence); the rest are prefill chunks laid back to back.
    """

    slot_mapping: torch.Tensor  # (num_tokens,) int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks) int32
    decode_context_lens: torch.Tensor  # (num_decodes,) int32
    decode_max_context_len: int
    prefill_block_tables: torch.Tensor  # (num_prefills, max_blocks) int32
    prefill_context_lens: torch.Tensor  # (num_prefills,) int32
    prefill_query_start_loc: torch.Tensor  # (num_prefills + 1,) int32, from 0
    prefill_max_query_len: int
    prefill_max_context_len: int


def paged_attention(
    ops: KernelOps,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q (T, H, D), k/v (T, Hk, D) -> (T, H, D); stores k/v into the cache first."""
    ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    nd = batch.num_decode_tokens
    parts = []
    if nd:
        parts.append(
            ops.paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                batch.decode_block_tables,
                batch.decode_context_lens,
                scale,
                batch.decode_max_context_len,
            )
        )
    if q.shape[0] > nd:
        parts.append(
            ops.paged_prefill_attention(
                q[nd:],
                k_cache,
                v_cache,
                batch.prefill_block_tables,
                batch.prefill_context_lens,
                batch.prefill_query_start_loc,
                scale,
                batch.prefill_max_query_len,
                batch.prefill_max_context_len,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)
