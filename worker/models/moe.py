"""The mixture-of-experts MLP block: a router, the routed experts, and the shared expert some add.

A layer's MLP is anything called as ``mlp(x, ops)``; ``SparseMoe`` is the
one MoE families use. The router turns each token's hidden state into its
top_k experts and their weights (``kernels/routing.py`` has each family's
rule), ``ops.fused_moe`` runs the experts (``kernels/experts.py``), and a
shared expert, where the family has one, runs on every token:
Qwen2-MoE scales its output by sigmoid(x @ shared_gate), DeepSeek adds it as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.kernels import ExpertWeights, KernelOps

# router logits (num_tokens, num_experts) -> (topk_weights fp32, topk_ids)
RouteFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
MlpFn = Callable[[torch.Tensor, KernelOps], torch.Tensor]


@dataclass(slots=True)
class Router:
    weight: torch.Tensor  # (hidden, num_experts), input-major
    bias: torch.Tensor | None  # (num_experts,), gpt-oss
    choose: RouteFn
    in_fp32: bool = False  # DeepSeek computes the logits in fp32 whatever the model's dtype

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight, bias = self.weight, self.bias
        if self.in_fp32:
            x, weight = x.float(), weight.float()
            bias = None if bias is None else bias.float()
        logits = torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)
        return self.choose(logits)


@dataclass(slots=True)
class SparseMoe:
    router: Router
    experts: ExpertWeights
    shared: MlpFn | None = None  # runs on every token
    shared_gate: torch.Tensor | None = None  # (hidden, 1): sigmoid(x @ gate) scales shared's output

    def __call__(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """(num_tokens, hidden) -> (num_tokens, hidden)."""
        weights, ids = self.router(x)
        out = ops.fused_moe(x, self.experts, weights, ids)
        if self.shared is not None:
            shared = self.shared(x, ops)
            if self.shared_gate is not None:
                shared = torch.sigmoid(torch.mm(x, self.shared_gate)) * shared
            out = out + shared
        return out
