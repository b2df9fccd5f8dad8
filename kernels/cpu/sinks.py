"""Attention with sinks on the CPU path: SDPA's output rescaled by the sink's share.

A sink (gpt-oss) is one more softmax column per head, with logit ``sink`` and
no value. Adding it leaves every key's weight divided by the same factor, so
the output is plain attention's output times Z / (Z + exp(sink)) =
sigmoid(lse - sink), lse = log Z being the log-sum-exp of the head's scores.
torch's CPU flash attention returns lse beside the output (the op SDPA runs on
the CPU), so a sink costs one elementwise op.
"""

from __future__ import annotations

import torch


def attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, Hk, S, D) (GQA as SDPA takes it), sinks (H,) -> (B, H, L, D).

    mask: additive float or boolean (True = visible), broadcast like SDPA's attn_mask.
    """
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    share = torch.sigmoid(lse - sinks.float()[None, :, None])  # (B, H, L)
    return out * share.unsqueeze(-1).to(out.dtype)
