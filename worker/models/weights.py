"""The tensors of a Llama-family model, in the layout the forward uses, and its one matmul.

Projections are fused (q/k/v into one matrix, gate/up into another) and
stored input-major, (in, out), the transpose of HF's (out, in): on the CPU,
MKL's products with few rows, which is what a decode step is, run 10-30%
faster with the weight in that layout than as a transposed operand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (hidden, (num_heads + 2 * num_kv_heads) * head_dim)
    qkv_bias: torch.Tensor | None  # ((num_heads + 2 * num_kv_heads) * head_dim,)
    q_norm: torch.Tensor | None  # (head_dim,), Qwen3
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor  # (num_heads * head_dim, hidden)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (hidden, 2 * intermediate)
    down: torch.Tensor  # (intermediate, hidden)


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (hidden, vocab); tied: the embedding's transpose (a view on CUDA)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) @ weight (in, out) (+ bias (out,)) -> (rows, out)."""
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)
