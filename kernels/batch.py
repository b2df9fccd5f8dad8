"""What paged attention reads for one step, and the per-step attention it is planned into.

Every layer of a step attends over the same sequences, so whatever can be
worked out from the batch alone (argument checks, how to cut the decode rows,
masks) is worked out once, when the step begins: ``KernelOps.attention(batch,
k_cache, v_cache, kind)`` returns a ``StepAttention`` that each layer of that
``AttentionKind`` then calls (a model with local and global layers plans two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class AttentionKind:
    """What a layer's attention computes beyond softmax(q.k * scale) v over its causal context."""

    scale: float
    window: int | None = None  # sliding window: a query at p sees keys p - window < j <= p
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax


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
    # the host arrays the tensors above were made from, for code that must know the
    # step's sequences on the host in every forward (reading the tensors would wait
    # for the device); None where no host copy is kept (captured CUDA graphs)
    host: HostBatch | None = None


@dataclass(frozen=True, slots=True)
class HostBatch:
    """The host side of an ``AttentionBatch`` (numpy, the same values)."""

    positions: np.ndarray  # (num_tokens,) int64
    decode_block_tables: np.ndarray  # (num_decodes, max_blocks) int32
    prefill_block_tables: np.ndarray  # (num_prefills, max_blocks) int32
    prefill_query_start_loc: np.ndarray  # (num_prefills + 1,) int32, from 0


class StepAttention(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer: q (T, H, D), k/v (T, Hk, D) -> (T, H, D); stores k/v into the cache first.

        sinks (H,): the layer's per-head sink logits (gpt-oss), if it has them.
        """
        ...
