"""One MoE layer's routed experts: their stacked weights and how each expert activates.

Every op that runs experts (``moe_reference.fused_moe``, the CPU path in
``cpu/routed_experts.py``, the Triton kernel in ``triton/fused_moe.py``) takes the same
``ExpertWeights`` and the router's choice, ``topk_ids`` (num_tokens, top_k)
expert ids in [0, num_experts) and ``topk_weights`` (num_tokens, top_k), and
returns (num_tokens, hidden): for each token the sum over its top_k experts of
weight * expert(x).

An expert is a gated MLP, stored input-major like the dense MLP (see
``worker/models/weights.py``): ``x @ w13[e] (+ b13[e])`` gives the gate and up
halves side by side (gate first), the activation turns them into (inter,), and
``@ w2[e] (+ b2[e])`` projects back to hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels import reference


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss: gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


@dataclass(slots=True)
class ExpertWeights:
    w13: torch.Tensor  # (num_experts, hidden, 2 * inter): gate columns, then up columns
    w2: torch.Tensor  # (num_experts, inter, hidden)
    b13: torch.Tensor | None = None  # (num_experts, 2 * inter), gpt-oss
    b2: torch.Tensor | None = None  # (num_experts, hidden), gpt-oss
    activation: ClampedSwiGLU | None = None  # None: silu(gate) * up

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def activate(h: torch.Tensor, activation: ClampedSwiGLU | None) -> torch.Tensor:
    """(rows, 2 * inter) gate/up -> (rows, inter), in torch."""
    if activation is None:
        return reference.silu_and_mul(h)
    return reference.clamped_swiglu(h, activation.alpha, activation.limit)
