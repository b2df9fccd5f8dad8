"""The Triton path's attention for one step: store K/V, decode rows, then prefill chunks.

Every layer of a step passes arguments of the same shapes, dtypes and strides
(one KV allocation, one model), so the first layer's are checked and the
others go straight to the kernel launches.
"""

from __future__ import annotations

import torch

from batchgen.kernels.batch import AttentionBatch, AttentionKind
from batchgen.kernels.triton.arg_checks import PagedAttentionShape
from batchgen.kernels.triton.decode_attention import check_decode_args, launch_decode
from batchgen.kernels.triton.prefill_attention import check_prefill_args, launch_prefill
from batchgen.kernels.triton.store_kv import store_kv


class TritonAttention:
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
        self.decode_shape: PagedAttentionShape | None = None
        self.prefill_shape: PagedAttentionShape | None = None
        self.checked = False

    def _check(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        b, nd = self.batch, self.batch.num_decode_tokens
        if nd:
            self.decode_shape = check_decode_args(
                q[:nd], k_cache, v_cache, b.decode_block_tables, b.decode_context_lens,
                b.decode_max_context_len,
            )  # fmt: skip
        if q.shape[0] > nd:
            self.prefill_shape = check_prefill_args(
                q[nd:], k_cache, v_cache, b.prefill_block_tables, b.prefill_context_lens,
                b.prefill_query_start_loc, b.prefill_max_query_len, b.prefill_max_context_len,
            )  # fmt: skip
        self.checked = True

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        if not self.checked:
            self._check(q, k_cache, v_cache)
        b, nd = self.batch, self.batch.num_decode_tokens
        store_kv(k, v, k_cache, v_cache, b.slot_mapping)
        parts = []
        if self.decode_shape is not None:
            out = launch_decode(
                self.decode_shape, q[:nd], k_cache, v_cache, b.decode_block_tables,
                b.decode_context_lens, self.scale, b.decode_max_context_len,
                window=self.kind.window, softcap=self.kind.softcap,
            )  # fmt: skip
            parts.append(out)
        if self.prefill_shape is not None:
            out = launch_prefill(
                self.prefill_shape, q[nd:], k_cache, v_cache, b.prefill_block_tables,
                b.prefill_context_lens, b.prefill_query_start_loc, self.scale,
                b.prefill_max_query_len, window=self.kind.window, softcap=self.kind.softcap,
            )  # fmt: skip
            parts.append(out)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
