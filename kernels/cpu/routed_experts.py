"""The CPU path's routed experts: each expert runs once, on exactly the tokens routed to it.

The (token, slot) pairs are sorted by expert once; each expert with pairs
then takes its contiguous run of gathered rows through two matmuls, and the
weighted results are added back into their tokens. Experts no token chose
cost nothing, which is what makes a decode step with top_k of 8 among 256
experts affordable. Same signature and semantics as ``moe_reference.fused_moe``.

MXFP4 experts (gpt-oss's checkpoint tensors) are dequantized one chosen expert
at a time (``dequantize_expert``): one table lookup per byte gives its two
e2m1 values, the power-of-two scale is applied in the compute dtype (exact in
bf16 and fp32), and gate_up's rows are put gate first while still bytes. Block-wise
FP8 experts and GPTQ / AWQ / compressed-tensors ones (``QuantizedExpertWeights``)
are dequantized to fp32 and then the compute dtype, as transformers' dequantizing
loaders round them, only the chosen experts: FP8 one whole expert at a time, GPTQ /
AWQ / compressed-tensors one tile of output features (at most 4 MiB of fp32) at a
time, as their dense projections are (a Mixtral-8x7B expert is 704 MB in fp32).
"""

from __future__ import annotations

import math

import torch

from batchgen.kernels.experts import (
    ExpertWeights,
    Fp8BlockExpertWeights,
    Mxfp4ExpertWeights,
    QuantizedExpertWeights,
    RoutedExperts,
    activate,
)
from batchgen.kernels.quant_reference import (
    E2M1_VALUES,
    dequantize_fp8_block,
    dequantize_fp8_block_expert,
)

# a byte's two e2m1 values, the low nibble first: (256, 2)
_BYTE_VALUES = torch.stack(
    (torch.tensor(E2M1_VALUES).repeat(16), torch.tensor(E2M1_VALUES).repeat_interleave(16)), -1
)
# each e4m3 byte's value: a lookup takes about half the time of torch's fp8 cast on the CPU
TILE_BYTES = 4 << 20  # one dequantized tile of a GPTQ / AWQ / compressed-tensors expert, fp32
E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def fused_moe(
    x: torch.Tensor,
    experts: RoutedExperts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x (num_tokens, hidden) -> (num_tokens, hidden) in x's dtype. MXFP4 experts (gpt-oss's
    stored layout) are dequantized to x's dtype one expert at a time, only those a token
    chose, so the extra memory is one expert's weights: exact, as every e2m1 value times
    a power of two is (the Triton kernel dequantizes inside its loop instead).
    Block-wise FP8 experts stay FP8 the same way: each expert with tokens is dequantized
    on its own, in fp32 then x's dtype as transformers' dequantizing loader rounds it;
    GPTQ / AWQ / compressed-tensors experts likewise, a tile at a time (``_quantized_expert``)."""
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
        target = out_rows[start : start + n]
        if isinstance(experts, QuantizedExpertWeights):
            _quantized_expert(rows[start : start + n], experts, e, target)
            start += n
            continue
        w13, b13, w2, b2 = _expert(experts, e, x.dtype)
        h = activate(_linear(rows[start : start + n], w13, b13), experts.activation)
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


def _quantized_expert(
    x: torch.Tensor, experts: QuantizedExpertWeights, e: int, out: torch.Tensor
) -> None:
    """Expert e on its rows x into out, its weights dequantized (fp32, then x's dtype) one
    tile of at most ``TILE_BYTES`` at a time, never whole: gate and up over the same run of
    intermediate features, activated into h, then down over runs of hidden features. A
    tile's columns are the same columns of dequantize-then-matmul."""
    gate, up, down = experts.gate[e], experts.up[e], experts.down[e]
    h = torch.empty(x.shape[0], gate.out_features, dtype=x.dtype, device=x.device)
    step = math.lcm(gate.column_step, up.column_step)
    for a, b in _tiles(gate.out_features, gate.in_features, step):
        g = torch.mm(x, gate.dequantize(a, b).to(x.dtype).t())
        u = torch.mm(x, up.dequantize(a, b).to(x.dtype).t())
        h[:, a:b] = activate(torch.cat((g, u), dim=1), experts.activation)
    for a, b in _tiles(down.out_features, down.in_features, down.column_step):
        out[:, a:b] = torch.mm(h, down.dequantize(a, b).to(x.dtype).t())


def _tiles(rows: int, columns: int, step: int) -> list[tuple[int, int]]:
    per_tile = max(step, TILE_BYTES // (4 * columns) // step * step)
    return [(a, min(a + per_tile, rows)) for a in range(0, rows, per_tile)]


def _expert(experts: RoutedExperts, e: int, dtype: torch.dtype) -> Tensors:
    """Expert e's (w13, b13, w2, b2): views of float experts; MXFP4 and block-FP8 ones
    dequantized, that expert alone, to ``dtype``."""
    assert not isinstance(experts, QuantizedExpertWeights)  # _quantized_expert runs those
    if isinstance(experts, Fp8BlockExpertWeights):
        gate_up, down = dequantize_fp8_block_expert(experts, e, _dequantize_fp8_block)
        return gate_up.to(dtype).t(), None, down.to(dtype).t(), None
    if isinstance(experts, Mxfp4ExpertWeights):
        experts, e = dequantize_expert(experts, e, dtype), 0
    b13 = None if experts.b13 is None else experts.b13[e]
    b2 = None if experts.b2 is None else experts.b2[e]
    return experts.w13[e], b13, experts.w2[e], b2


def dequantize_expert(experts: Mxfp4ExpertWeights, e: int, dtype: torch.dtype) -> ExpertWeights:
    """Expert e of MXFP4 experts as a one-expert ``ExpertWeights`` in ``dtype``: bit for bit
    ``quant_reference.dequantize_mxfp4_experts``'s expert e, cast to ``dtype``."""
    compute = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    rows = experts.gate_up_blocks.shape[1]
    gate_first = torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))

    def weight(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        values = torch.nn.functional.embedding(blocks.int(), _BYTE_VALUES.to(compute))
        scale = torch.exp2(scales.float() - 127).to(compute)  # a power of two: exact
        out = (values.flatten(-2) * scale[..., None]).flatten(-2)  # (N, K)
        return out.t().to(dtype).contiguous()[None]  # input-major (1, K, N)

    def bias(t: torch.Tensor | None, order: torch.Tensor | slice) -> torch.Tensor | None:
        return None if t is None else t[e, order].to(dtype)[None]

    return ExpertWeights(
        weight(experts.gate_up_blocks[e, gate_first], experts.gate_up_scales[e, gate_first]),
        weight(experts.down_blocks[e], experts.down_scales[e]),
        bias(experts.gate_up_bias, gate_first), bias(experts.down_bias, slice(None)),
    )  # fmt: skip


def _dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``quant_reference.dequantize_fp8_block``'s values (the same fp32 products), faster:
    the bytes looked up, each whole block scaled in place."""
    (n, k), (bn, bk) = weight.shape, block
    if n % bn or k % bk or weight.device != E4M3_VALUES.device:  # CPU ops on CUDA weights
        return dequantize_fp8_block(weight, scale_inv, block)
    values = E4M3_VALUES.index_select(0, weight.view(torch.uint8).flatten().int())
    blocks = values.view(n // bn, bn, k // bk, bk)
    return blocks.mul_(scale_inv.float()[:, None, :, None]).view(n, k)
