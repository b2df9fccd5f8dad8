"""What the engine calls on a model, whichever implementation runs it."""

from __future__ import annotations

from typing import Protocol

import torch

from batchgen.kernels.batch import AttentionBatch
from batchgen.kernels.ops import KernelOps


class ModelShape(Protocol):
    """What the engine reads of a model's config: batchgen's ``ModelConfig`` or the
    transformers backend's ``BackendConfig``."""

    @property
    def vocab_size(self) -> int: ...  # the width of the logits
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...  # KV cache layers
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def windows(self) -> tuple[int | None, ...]: ...  # each KV layer's sliding window
    @property
    def release_window(self) -> int | None: ...  # see model_config.release_window
    @property
    def kv_shared(self) -> bool: ...  # K and V are one tensor (MLA's latent)


class CausalLM(Protocol):
    @property
    def config(self) -> ModelShape: ...

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
