"""The mixture-of-experts MLP block: a router, the routed experts, and the shared expert some add.

A layer's MLP is anything called as ``mlp(x, ops)`` (``mlp.MlpBlock``);
``SparseMoe`` is the one the MoE families use. The router turns each token's
hidden state into its top_k experts and their weights (``kernels/routing.py``
has each family's rule, chosen by ``MoeSpec.router``), ``ops.fused_moe`` runs
the experts (``kernels/experts.py``), and a shared expert, where the family
has one, runs on every token: Qwen2-MoE scales its output by
sigmoid(x @ shared_gate), DeepSeek adds it as is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.kernels.experts import RoutedExperts
from batchgen.kernels.ops import KernelOps
from batchgen.kernels.routing import GroupedTopK, softmax_topk, topk_softmax
from batchgen.worker.models.layers.mlp import MlpBlock
from batchgen.worker.models.model_config import MoeSpec, RouterKind
from batchgen.worker.models.weights import Linear

# router logits (num_tokens, num_experts) -> (topk_weights fp32, topk_ids)
RouteFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def route_fn(spec: MoeSpec, correction_bias: torch.Tensor | None) -> RouteFn:
    """The family's routing rule, as transformers' router computes it."""
    if spec.router is RouterKind.SOFTMAX_TOPK:
        return functools.partial(softmax_topk, top_k=spec.top_k, renormalize=spec.renormalize)
    if spec.router is RouterKind.TOPK_SOFTMAX:
        return functools.partial(topk_softmax, top_k=spec.top_k)
    grouped = GroupedTopK(
        spec.top_k, spec.num_groups, spec.topk_group, spec.sigmoid, spec.renormalize,
        spec.scaling_factor,
    )  # fmt: skip
    return functools.partial(grouped, correction_bias=correction_bias)


@dataclass(slots=True)
class Router:
    gate: Linear  # (hidden, num_experts), with gpt-oss's bias
    choose: RouteFn
    in_fp32: bool = False  # DeepSeek computes the logits in fp32 whatever the model's dtype

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.choose(self.gate(x.float() if self.in_fp32 else x))


@dataclass(slots=True)
class SparseMoe:
    router: Router
    experts: RoutedExperts  # quantized ones as stored: MXFP4, FP8, GPTQ, AWQ, compressed-tensors
    shared: MlpBlock | None = None  # runs on every token
    shared_gate: Linear | None = None  # (hidden, 1): sigmoid(x @ gate) scales shared's output

    def __call__(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        """(num_tokens, hidden) -> (num_tokens, hidden)."""
        weights, ids = self.router(x)
        out = ops.fused_moe(x, self.experts, weights, ids)
        if self.shared is not None:
            shared = self.shared(x, ops)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out
