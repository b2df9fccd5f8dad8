"""The CPU path's routed experts: each expert runs once, on exactly the tokens routed to it.

The (token, slot) pairs are sorted by expert once; each expert with pairs
then takes its contiguous run of gathered rows through two matmuls, and the
weighted results are added back into their tokens. Experts no token chose
cost nothing, which is what makes a decode step with top_k of 8 among 256
experts affordable. Same signature and semantics as ``moe_reference.fused_moe``.
"""

from __future__ import annotations

import torch

from batchgen.kernels.experts import ExpertWeights, Mxfp4ExpertWeights, activate
from batchgen.kernels.quant_reference import dequantize_mxfp4_experts


def fused_moe(
    x: torch.Tensor,
    experts: ExpertWeights | Mxfp4ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x (num_tokens, hidden) -> (num_tokens, hidden) in x's dtype. MXFP4 experts (gpt-oss's
    stored layout) are dequantized to x's dtype one expert at a time, only those a token
    chose, so the extra memory is one expert's weights: exact, as every e2m1 value times
    a power of two is (the Triton kernel dequantizes inside its loop instead)."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)  # pairs grouped by expert, tokens ascending within
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    tokens = order // top_k
    rows = x.index_select(0, tokens)
    out_rows = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        w13, b13, w2, b2 = _expert(experts, e, x.dtype)
        h = activate(_linear(rows[start : start + n], w13, b13), experts.activation)
        target = out_rows[start : start + n]
        if b2 is None:
            torch.mm(h, w2, out=target)
        else:
            torch.addmm(b2, h, w2, out=target)
        start += n
    weights = topk_weights.reshape(-1).index_select(0, order)
    if weights.dtype != out_rows.dtype:  # weigh half-precision rows in fp32, like transformers
        out_rows, weights = out_rows.float(), weights.float()
    out_rows.mul_(weights[:, None])
    summed = torch.zeros(x.shape, dtype=out_rows.dtype, device=x.device)
    return summed.index_add_(0, tokens, out_rows).to(x.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


Tensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


def _expert(experts: ExpertWeights | Mxfp4ExpertWeights, e: int, dtype: torch.dtype) -> Tensors:
    """Expert e's (w13, b13, w2, b2): views of float experts; MXFP4 ones dequantized,
    that expert alone, to ``dtype``."""
    if isinstance(experts, Mxfp4ExpertWeights):
        experts, e = _dequantized(experts, slice(e, e + 1), dtype), 0
    b13 = None if experts.b13 is None else experts.b13[e]
    b2 = None if experts.b2 is None else experts.b2[e]
    return experts.w13[e], b13, experts.w2[e], b2


def _dequantized(experts: Mxfp4ExpertWeights, some: slice, dtype: torch.dtype) -> ExpertWeights:
    pick = lambda t: None if t is None else t[some]  # noqa: E731
    dense = dequantize_mxfp4_experts(Mxfp4ExpertWeights(
        experts.gate_up_blocks[some], experts.gate_up_scales[some], experts.down_blocks[some],
        experts.down_scales[some], pick(experts.gate_up_bias), pick(experts.down_bias),
    ))  # fmt: skip
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return ExpertWeights(dense.w13.to(dtype), dense.w2.to(dtype), cast(dense.b13), cast(dense.b2))
