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
from typing import Protocol

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


@dataclass(slots=True)
class Mxfp4ExpertWeights:
    """gpt-oss's routed experts as its checkpoint stores them: MXFP4, e2m1 pairs with e8m0 scales.

    Each projection is output-major, ``*_blocks`` uint8 (E, N, K/32, 16) two
    e2m1 values a byte (low nibble first) and ``*_scales`` uint8 (E, N, K/32),
    one power of two 2^(s-127) per 32 inputs (``quant_reference.dequantize_mxfp4``).
    gate_up's rows, and its bias, interleave gate and up (row 2i gate i, row
    2i+1 up i), as gpt-oss's ``gate_up_proj`` does.
    """

    gate_up_blocks: torch.Tensor  # (num_experts, 2 * inter, hidden / 32, 16) uint8
    gate_up_scales: torch.Tensor  # (num_experts, 2 * inter, hidden / 32) uint8
    down_blocks: torch.Tensor  # (num_experts, hidden, inter / 32, 16) uint8
    down_scales: torch.Tensor  # (num_experts, hidden, inter / 32) uint8
    gate_up_bias: torch.Tensor | None = None  # (num_experts, 2 * inter), interleaved
    down_bias: torch.Tensor | None = None  # (num_experts, hidden)
    activation: ClampedSwiGLU | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up_blocks.shape[0]


@dataclass(slots=True)
class Fp8BlockExpertWeights:
    """Routed experts as block-wise FP8 checkpoints store them (DeepSeek-V3/R1, Qwen3 -FP8).

    Output-major float8_e4m3fn weights, each (bn, bk) block of a projection
    times its fp32 ``weight_scale_inv`` (``quant_reference.dequantize_fp8_block``).
    gate_up holds each expert's gate rows then up rows, its scale grid gate's
    grid then up's (gate and up are separate tensors on disk, so a partial last
    block of gate stays partial). Half the bytes of bf16 experts, plus the scales.
    """

    gate_up: torch.Tensor  # (num_experts, 2 * inter, hidden) float8_e4m3fn
    gate_up_scale_inv: torch.Tensor  # (num_experts, 2 * ceil(inter / bn), ceil(hidden / bk))
    down: torch.Tensor  # (num_experts, hidden, inter) float8_e4m3fn
    down_scale_inv: torch.Tensor  # (num_experts, ceil(hidden / bn), ceil(inter / bk))
    block: tuple[int, int]  # (bn, bk): weight_block_size
    activation: ClampedSwiGLU | None = None
    # each expert's (gate, up, down) modules as the checkpoint names them (refusals)
    names: tuple[tuple[str, str, str], ...] = ()

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]


class ExpertProjection(Protocol):
    """One expert's gate, up or down projection as its checkpoint stores it (GPTQ, AWQ,
    compressed-tensors: ``worker/models/quant/scheme.py``'s ``QuantizedWeight``)."""

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def column_step(self) -> int:
        """dequantize's start and stop are multiples of this (rows sharing packed words)."""
        ...

    def dequantize(self, start: int, stop: int) -> torch.Tensor:
        """Output features [start, stop) as fp32 (stop - start, in_features)."""
        ...


@dataclass(slots=True)
class QuantizedExpertWeights:
    """Routed experts as GPTQ, AWQ and compressed-tensors checkpoints store them: each
    expert's gate, up and down projection its own packed integers and scales
    (``model.layers.N.mlp.experts.E.gate_proj.qweight``, ``...weight_packed``), kept in
    that layout; the CPU product dequantizes the experts with tokens, one tile of output
    features at a time (``cpu/routed_experts.py``)."""

    gate: tuple[ExpertProjection, ...]  # per expert, output-major (inter, hidden)
    up: tuple[ExpertProjection, ...]
    down: tuple[ExpertProjection, ...]  # (hidden, inter)
    activation: ClampedSwiGLU | None = None
    names: tuple[tuple[str, str, str], ...] = ()  # as Fp8BlockExpertWeights.names

    @property
    def num_experts(self) -> int:
        return len(self.gate)


# every layout the fused-MoE ops take
RoutedExperts = ExpertWeights | Mxfp4ExpertWeights | Fp8BlockExpertWeights | QuantizedExpertWeights


def activate(h: torch.Tensor, activation: ClampedSwiGLU | None) -> torch.Tensor:
    """(rows, 2 * inter) gate/up -> (rows, inter), in torch."""
    if activation is None:
        return reference.silu_and_mul(h)
    return reference.clamped_swiglu(h, activation.alpha, activation.limit)
