"""MoE routers: router logits -> (topk_weights fp32, topk_ids), as transformers computes them.

Each function takes the router's logits (num_tokens, num_experts) and returns
the ``topk_weights`` (num_tokens, top_k) fp32 and ``topk_ids`` (num_tokens,
top_k) int64 that the expert ops take (``experts.py``). They are a few torch
ops each, the same on every device; the order of operations follows
transformers' routers so that the same logits choose the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral (renormalize), Qwen2-MoE and Qwen3-MoE (``norm_topk_prob``): softmax over
    all experts, the top_k probabilities, optionally rescaled to sum to 1."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: the top_k logits (the router has a bias, already in ``logits``), softmaxed among themselves."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values.float(), dim=-1), ids


@dataclass(frozen=True, slots=True)
class GroupedTopK:
    """DeepSeek's router: experts in ``num_groups`` groups; the best ``topk_group`` groups
    are kept and top_k experts chosen among them.

    V2: softmax scores; a group is scored by its best expert ("group_limited_greedy";
    ``num_groups`` 1 is plain "greedy"); no renormalisation.
    V3: sigmoid scores; the choice (not the weights) adds ``e_score_correction_bias``;
    a group is scored by the sum of its two best experts; weights renormalised
    (``norm_topk_prob``). Both scale the weights by ``routed_scaling_factor``.
    """

    top_k: int
    num_groups: int
    topk_group: int
    sigmoid: bool  # V3's scoring; softmax otherwise (V2)
    renormalize: bool
    scaling_factor: float

    def __call__(
        self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        num_tokens, num_experts = choice.shape
        masked_fill = float("-inf") if self.sigmoid else 0.0  # as transformers masks each
        if self.num_groups > 1:
            grouped = choice.view(num_tokens, self.num_groups, num_experts // self.num_groups)
            if self.sigmoid:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            kept = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).bool()
            expert_mask = group_mask.repeat_interleave(num_experts // self.num_groups, dim=1)
            choice = choice.masked_fill(~expert_mask, masked_fill)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        # V2 weighs by the masked scores, V3 by the scores without the bias
        weights = (scores if self.sigmoid else choice).gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling_factor, ids
