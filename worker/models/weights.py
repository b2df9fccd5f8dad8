"""The tensors of a Llama-family model, in the fused layout the forward uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # ((num_heads + 2 * num_kv_heads) * head_dim, hidden)
    qkv_bias: torch.Tensor | None  # ((num_heads + 2 * num_kv_heads) * head_dim,)
    q_norm: torch.Tensor | None  # (head_dim,), Qwen3
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor  # (hidden, num_heads * head_dim)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden)
    down: torch.Tensor  # (hidden, intermediate)


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (vocab, hidden); the embedding itself when tied
