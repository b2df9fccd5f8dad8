"""What the engine calls on a model, whichever implementation runs it."""

from __future__ import annotations

from typing import Protocol

import torch

from batchgen.kernels import AttentionBatch, KernelOps
from batchgen.worker.models.model_config import ModelConfig


class CausalLM(Protocol):
    config: ModelConfig
    ops: KernelOps  # the kernel set it runs on

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions (num_tokens,) -> final hidden states (num_tokens, hidden);
        stores the tokens' K/V at batch.slot_mapping in every layer's cache."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, hidden) -> (num_rows, vocab) fp32."""
        ...
