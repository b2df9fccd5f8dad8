"""The Triton path's attention for one step: store K/V, decode rows, then prefill chunks.

Every layer of a step passes arguments of the same shapes, dtypes and strides
(one KV allocation, one model; sinks, where a model has them, in every layer),
so the first layer's are checked and the others go straight to the kernel
launches.

MLA's latent cache (one tensor as k_cache and v_cache, one row per token) goes
to ``latent_decode.py``'s kernel, prefill chunks included: each chunk token is
a row of its own over its causal prefix (the chunk's rows are stored first),
which reads the prefix once per token but needs no kernel beyond the decode one.
"""

from __future__ import annotations

import torch

from batchgen.kernels.batch import AttentionBatch, AttentionKind
from batchgen.kernels.triton import decode_attention, latent_decode, prefill_attention
from batchgen.kernels.triton.arg_checks import PagedAttentionShape, check_sinks
from batchgen.kernels.triton.decode_attention import check_decode_args, launch_decode
from batchgen.kernels.triton.latent_decode import check_latent_decode_args, launch_latent_decode
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
        # MLA: (block_tables, context_lens) of each prefill token as a row of its own
        self.latent = False  # MLA's latent cache: the latent kernel for every row
        self.latent_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self.checked = False

    def _check(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None,
    ) -> None:
        b, nd = self.batch, self.batch.num_decode_tokens
        if is_latent_cache(k_cache, v_cache):
            self._check_latent(q, k_cache, sinks)
            return
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
        for shape in (self.decode_shape, self.prefill_shape):
            if shape is not None:
                check_sinks(sinks, shape)
        self.checked = True

    def _check_latent(
        self, q: torch.Tensor, cache: torch.Tensor, sinks: torch.Tensor | None
    ) -> None:
        b, nd, kind = self.batch, self.batch.num_decode_tokens, self.kind
        if kind.window is not None or kind.softcap is not None or sinks is not None:
            raise ValueError("the latent (MLA) kernel has no window, softcap or sinks")
        self.latent = True
        if nd:
            self.decode_shape = check_latent_decode_args(
                q[:nd], cache, b.decode_block_tables, b.decode_context_lens,
                b.decode_max_context_len,
            )  # fmt: skip
        if q.shape[0] > nd:
            self.latent_rows = prefill_token_rows(b, q.shape[0] - nd)
            self.prefill_shape = check_latent_decode_args(
                q[nd:], cache, *self.latent_rows, b.prefill_max_context_len
            )
        self.checked = True

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.checked:
            self._check(q, k_cache, v_cache, sinks)
        b, nd = self.batch, self.batch.num_decode_tokens
        store_kv(k, v, k_cache, v_cache, b.slot_mapping)
        if self.latent:
            return self._latent_attention(q, k_cache)
        parts = []
        if self.decode_shape is not None:
            out = launch_decode(
                self.decode_shape, q[:nd], k_cache, v_cache, b.decode_block_tables,
                b.decode_context_lens, self.scale, b.decode_max_context_len,
                window=self.kind.window, softcap=self.kind.softcap, sinks=sinks,
            )  # fmt: skip
            parts.append(out)
        if self.prefill_shape is not None:
            out = launch_prefill(
                self.prefill_shape, q[nd:], k_cache, v_cache, b.prefill_block_tables,
                b.prefill_context_lens, b.prefill_query_start_loc, self.scale,
                b.prefill_max_query_len, window=self.kind.window, softcap=self.kind.softcap,
                sinks=sinks,
            )  # fmt: skip
            parts.append(out)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _latent_attention(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        b, nd = self.batch, self.batch.num_decode_tokens
        parts = []
        if self.decode_shape is not None:
            parts.append(launch_latent_decode(
                self.decode_shape, q[:nd], cache, b.decode_block_tables, b.decode_context_lens,
                self.scale, b.decode_max_context_len,
            ))  # fmt: skip
        if self.prefill_shape is not None and self.latent_rows is not None:
            parts.append(launch_latent_decode(
                self.prefill_shape, q[nd:], cache, *self.latent_rows, self.scale,
                b.prefill_max_context_len,
            ))  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def is_latent_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """MLA's cache: one tensor read as keys and as values, one row per token."""
    return k_cache is v_cache and k_cache.dim() == 4 and k_cache.shape[2] == 1


def prefill_token_rows(batch: AttentionBatch, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prefill token's (block table row, context length) as a decode row of its own:
    token t of a chunk ending at e in a sequence of context c sees c - (e - 1 - t) keys.
    On the device, without a host sync."""
    starts, lens = batch.prefill_query_start_loc, batch.prefill_context_lens
    token = torch.arange(num_tokens, device=starts.device, dtype=starts.dtype)
    seq = torch.searchsorted(starts[1:].contiguous(), token, right=True)
    context = lens[seq] - (starts[seq + 1] - 1 - token).to(lens.dtype)
    return batch.prefill_block_tables[seq], context


def attention_limits(
    num_heads: int, num_kv_heads: int, head_dim: int, kv_shared: bool
) -> str | None:
    """Why the attention kernels cannot take this shape (register budget), or None.

    MLA's latent cache (``kv_shared``, one row per token) runs on the latent
    kernel, which cuts the heads into blocks and the row at a power of two.
    """
    if kv_shared and num_kv_heads == 1:
        if 16 <= head_dim <= latent_decode.MAX_HEAD_DIM:
            return None
        return (
            f"a latent (MLA) row of {head_dim} is beyond the Triton latent kernel (16 to "
            f"{latent_decode.MAX_HEAD_DIM}); run it on the CPU path (use_triton=False)"
        )
    group = num_heads // max(num_kv_heads, 1)
    max_dim = min(decode_attention.MAX_HEAD_DIM, prefill_attention.MAX_HEAD_DIM)
    max_group = min(decode_attention.MAX_GROUP, prefill_attention.MAX_GROUP)
    if head_dim > max_dim or group > max_group:
        return (
            f"attention head_dim {head_dim} with {group} query heads per KV head is beyond the "
            f"Triton attention kernels (head_dim <= {max_dim}, <= {max_group} heads per KV "
            "head); run it on the CPU path (use_triton=False)"
        )
    return None
