"""A projection's tensors in the layout the forward uses, and its one matmul.

Projections are stored input-major, (in, out), the transpose of HF's
nn.Linear (out, in): on the CPU, MKL's products with few rows, which is what
a decode step is, run 10-30% faster with the weight in that layout than as a
transposed operand. Projections that read the same input are fused into one
matrix (q/k/v, gate/up) when read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (rows, in) @ weight (in, out) (+ bias (out,)) -> (rows, out)."""
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


@dataclass(slots=True)
class Linear:
    weight: torch.Tensor  # (in, out)
    bias: torch.Tensor | None = None  # (out,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]


def fuse(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] = ()) -> Linear:
    """HF (out_i, in) weights (and their biases, all or none) -> one input-major Linear."""
    weight = torch.cat(list(weights)).t().contiguous()
    present = [b for b in biases if b is not None]
    if present and len(present) != len(weights):
        raise ValueError("fused projections must all have a bias or none")
    return Linear(weight, torch.cat(present) if present else None)
