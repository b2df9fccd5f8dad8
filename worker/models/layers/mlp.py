"""The dense MLP: gated (act(gate) * up, one fused matrix) or plain (act(fc1)), biases as told.

A layer's MLP is anything with ``__call__(x, ops)`` (``MlpBlock``); the
mixture-of-experts blocks of the MoE families plug in there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from batchgen.kernels.ops import KernelOps
from batchgen.worker.models.model_config import MlpSpec
from batchgen.worker.models.weights import Linear


def _gelu_new(x: torch.Tensor) -> torch.Tensor:  # transformers' NewGELUActivation, as written
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:  # transformers' FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


# config's hidden_act -> the function transformers applies under that name
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
}


class MlpBlock(Protocol):
    def __call__(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """(num_tokens, hidden) -> (num_tokens, hidden)."""
        ...


@dataclass(slots=True)
class DenseMlp:
    spec: MlpSpec
    up: Linear  # gated: gate and up fused, (hidden, 2 * inter); plain: fc1 (hidden, inter)
    down: Linear  # (inter, hidden)

    def __call__(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        h = self.up(x)
        act = self.spec.activation
        if not self.spec.gated:
            h = ACTIVATIONS[act](h)
        elif act in ("silu", "swish"):
            h = ops.silu_and_mul(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            h = ACTIVATIONS[act](gate) * up
        return self.down(h)
