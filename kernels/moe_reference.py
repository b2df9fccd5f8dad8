"""Routed experts the plainest way: the oracle the CPU path and the Triton kernel are tested against.

A loop over every expert: pick the (token, slot) pairs routed to it, run the
expert on those tokens in fp32, weight and add. Slow, and right by inspection.
"""

from __future__ import annotations

import torch

from batchgen.kernels.experts import ExpertWeights, activate


def fused_moe(
    x: torch.Tensor,
    experts: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x (num_tokens, hidden) -> (num_tokens, hidden) in x's dtype; see ``experts.py``."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(experts.num_experts):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token].float() @ experts.w13[e].float()
        if experts.b13 is not None:
            h = h + experts.b13[e].float()
        y = activate(h, experts.activation) @ experts.w2[e].float()
        if experts.b2 is not None:
            y = y + experts.b2[e].float()
        out.index_add_(0, token, y * topk_weights[token, slot, None].float())
    return out.to(x.dtype)
