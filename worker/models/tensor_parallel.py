"""Tensor parallelism: one rank's shard of a native decoder, cut from the weights the readers made.

The split is Megatron's. Per layer, attention is column-parallel on its
heads (the fused q/k/v projection keeps this rank's query heads and the KV
heads they read, a per-head q/k norm and gpt-oss's sinks their rows, MLA its
queries' heads and the latent's up-projections) and row-parallel on ``o``;
the MLP is column-parallel on gate/up and row-parallel on ``down``. Each
block's partial output is summed over the ranks by one all-reduce
(``ReducedAttention``, ``ReducedMlp``); a bias of a row-parallel projection stays on rank 0 only,
so it is added once. The embedding and the LM head are split by vocabulary:
each rank looks up the tokens its rows hold (an all-reduce puts the rows
together) and computes the logits of its columns (an all-gather puts them
side by side). Norms, rotary tables, routers and MLA's down-projections are
replicated.

The KV cache follows the heads: each rank caches its KV heads only; when the
ranks outnumber the KV heads (and MLA's one latent), each KV head is cached
by the ranks whose query heads read it.

MoE experts are split tensor-parallel inside each expert (every rank holds a
slice of every expert's intermediate width), not expert-parallel: the router
is replicated, so every rank runs the same tokens through the same experts
with the same kernel, its work does not depend on how skewed the routing is,
and the block needs the same one all-reduce as a dense MLP (expert
parallelism needs an all-to-all to send tokens to their experts' ranks and
leaves a rank idle while a popular expert's rank works).

The readers read each plain projection, the embedding and the LM head as this
rank's slice only (worker/models/tensor_shard.py's ``RankSlices`` says which,
worker/models/loader.py reads just those bytes); what they read whole is cut
here after each layer is read, so the readers (and what they learn about
checkpoints) are the same for one rank and many. A tensor that already has
its shard's size was read as that shard: the cut keeps it (a cut the size of
the whole tensor keeps all of it in order, so this never mistakes a whole one).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from batchgen.kernels.batch import StepAttention
from batchgen.kernels.experts import (
    ExpertWeights,
    Fp8BlockExpertWeights,
    QuantizedExpertWeights,
    RoutedExperts,
)
from batchgen.kernels.ops import KernelOps
from batchgen.worker.models.decoder import Decoder, DecoderLayer, DecoderWeights
from batchgen.worker.models.layers.latent_attention import LatentAttention
from batchgen.worker.models.layers.mlp import DenseMlp, MlpBlock
from batchgen.worker.models.layers.norms import Norm
from batchgen.worker.models.layers.rope import RopeTable
from batchgen.worker.models.layers.self_attention import AttentionBlock, SelfAttention
from batchgen.worker.models.layers.sparse_moe import SparseMoe
from batchgen.worker.models.loader import read_checkpoint
from batchgen.worker.models.model_config import ModelConfig
from batchgen.worker.models.quant.linear import QuantizedLinear
from batchgen.worker.models.quant.quantized_experts import on_device
from batchgen.worker.models.quant.sharding import column_shard, experts_shard, row_shard
from batchgen.worker.models.tensor_shard import (
    HeadSplit,
    Shard,
    check_shardable,
    rank_slices,
    split_heads,
    vocab_span,
)
from batchgen.worker.models.tensor_store import ReadCount
from batchgen.worker.models.weights import Linear
from batchgen.worker.worker_errors import UnsupportedModelError


def _cols(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if t.shape[-1] == index.numel():  # read as this rank's slice
        return t
    return t.index_select(-1, index.to(t.device)).contiguous()


def _rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    if t.shape[0] == end - start:  # read as this rank's slice
        return t
    return t[start:end].contiguous()


def _column_linear(layer: Linear, index: torch.Tensor) -> Linear:
    """Column-parallel: this rank's output columns (and their bias)."""
    if isinstance(layer, QuantizedLinear):
        return column_shard(layer, index)
    assert layer.packed is None, "shard before the first call packs the weight"
    bias = None if layer.bias is None else _cols(layer.bias, index)
    return Linear(_cols(layer.weight, index), bias)


def _row_linear(layer: Linear, start: int, end: int, shard: Shard) -> Linear:
    """Row-parallel: this rank's input rows; the bias is added once, on rank 0."""
    if isinstance(layer, QuantizedLinear):
        return row_shard(layer, start, end, keep_bias=shard.rank == 0)
    assert layer.packed is None, "shard before the first call packs the weight"
    bias = layer.bias if shard.rank == 0 else None
    return Linear(_rows(layer.weight, start, end), bias)


def _head_columns(heads: tuple[int, int], width: int, offset: int = 0) -> torch.Tensor:
    return offset + torch.arange(heads[0] * width, heads[1] * width)


def _gated_columns(inter: int, span: tuple[int, int]) -> torch.Tensor:
    """The columns of a fused (gate | up) projection that hold intermediate [start, end)."""
    part = torch.arange(*span)
    return torch.cat((part, inter + part))


@dataclass(slots=True)
class ReducedAttention:
    """Attention whose output, partial on each rank (its heads' share of ``o``), is summed
    over the ranks."""

    block: AttentionBlock
    shard: Shard

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RopeTable | None,
        attend: StepAttention,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ops: KernelOps,
    ) -> torch.Tensor:
        out = self.block(x, positions, rope, attend, k_cache, v_cache, ops)
        return self.shard.all_reduce(out)


@dataclass(slots=True)
class ReducedMlp:
    """An MLP (dense or MoE) whose output, partial on each rank, is summed over the ranks."""

    block: MlpBlock
    shard: Shard

    def __call__(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return self.shard.all_reduce(self.block(x, ops))


class ShardedDecoder(Decoder):
    """The decoder of one rank: vocabulary-parallel embedding and LM head around
    layers whose blocks end in an all-reduce."""

    def __init__(
        self,
        config: ModelConfig,
        weights: DecoderWeights,
        ops: KernelOps,
        max_positions: int,
        device: torch.device,
        shard: Shard,
        vocab: tuple[int, int],
        vocab_per_rank: int,
        reads: ReadCount,
    ) -> None:
        super().__init__(config, weights, ops, max_positions, device)
        self.shard = shard
        self.vocab = vocab  # this rank's rows of the embedding, columns of the LM head
        self.vocab_per_rank = vocab_per_rank  # the widest rank's; narrower ones pad to it
        self.reads = reads  # what building it read from the checkpoint's files

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, end = self.vocab
        mine = (input_ids >= start) & (input_ids < end)
        rows = F.embedding((input_ids - start) * mine, self.weights.embed)
        return self.shard.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.weights.lm_head(hidden)
        if local.shape[-1] < self.vocab_per_rank:
            local = F.pad(local, (0, self.vocab_per_rank - local.shape[-1]))
        parts = self.shard.all_gather(local.contiguous())
        return torch.cat(parts, dim=-1)[:, : self.config.vocab_size]


def build_sharded_model(
    path: str | Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    ops: KernelOps,
    max_positions: int,
    shard: Shard,
) -> ShardedDecoder:
    """``registry.build_model`` for one rank: the checkpoint read on the CPU a layer at a
    time, its split tensors read as this rank's slices and the rest of each layer cut to
    its shard as soon as it is read, and only the shard moved to ``device``; the
    decoder's ``reads`` says what the rank read from the checkpoint's files."""
    from batchgen.worker.models.registry import BY_NAME

    family = BY_NAME[config.family]
    check_shardable(config, shard.world)
    store = read_checkpoint(Path(path), torch.device("cpu"), dtype)
    store.quantization = config.quantization
    a = config.attention
    heads = split_heads(a.num_heads, a.num_kv_heads, shard, config.family)
    store.slices = rank_slices(config, heads, shard)
    store.cut_layer = functools.partial(_shard_layer, config=config, heads=heads, shard=shard)
    store.gemms = ops.quant_gemms
    weights = family.read_weights(store, config)
    store.check_all_taken(family.name)
    local_config, local, vocab, vocab_per_rank = _shard_vocab(config, weights, shard, heads)
    local = _to_device(local, device)
    _experts_on_device(local, device, dtype)
    return ShardedDecoder(local_config, local, ops, max_positions, device, shard, vocab,
                          vocab_per_rank, store.reads)  # fmt: skip


def _shard_vocab(
    config: ModelConfig, weights: DecoderWeights, shard: Shard, heads: HeadSplit
) -> tuple[ModelConfig, DecoderWeights, tuple[int, int], int]:
    """This rank's config (its heads and KV heads), weights (the layers already cut),
    vocabulary span and the widest span's size."""
    a = config.attention
    vocab, per_rank = vocab_span(config.vocab_size, shard)
    lm_head = _column_linear(weights.lm_head, torch.arange(*vocab))
    local = DecoderWeights(
        embed=_rows(weights.embed, *vocab),
        layers=weights.layers,
        final_norm=weights.final_norm,
        lm_head=lm_head,
        position_embed=weights.position_embed,
    )
    attention = replace(a, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads)
    return replace(config, attention=attention), local, vocab, per_rank


def _shard_layer(
    layer: DecoderLayer, config: ModelConfig, heads: HeadSplit, shard: Shard
) -> DecoderLayer:
    return replace(
        layer,
        attention=ReducedAttention(_shard_attention(layer.attention, config, heads, shard), shard),
        mlp=ReducedMlp(_shard_mlp(layer.mlp, shard), shard),
    )


def _shard_attention(
    block: AttentionBlock, config: ModelConfig, heads: HeadSplit, shard: Shard
) -> AttentionBlock:
    if isinstance(block, SelfAttention):
        return _shard_self_attention(block, heads, shard)
    if isinstance(block, LatentAttention):
        return _shard_latent_attention(block, heads, shard)
    raise UnsupportedModelError(
        f"{config.family}: tensor parallelism cannot split its {type(block).__name__}"
    )


def _shard_self_attention(block: SelfAttention, heads: HeadSplit, shard: Shard) -> SelfAttention:
    s, dim = block.spec, block.spec.head_dim
    cols = torch.cat((
        _head_columns(heads.q, dim),
        _head_columns(heads.kv, dim, s.num_heads * dim),
        _head_columns(heads.kv, dim, (s.num_heads + s.num_kv_heads) * dim),
    ))  # fmt: skip
    q_rows = (heads.q[0] * dim, heads.q[1] * dim)
    return SelfAttention(
        spec=replace(s, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads),
        qkv=_column_linear(block.qkv, cols),
        o=_row_linear(block.o, *q_rows, shard),
        q_norm=_per_head_norm(block.q_norm, heads.q),
        k_norm=_per_head_norm(block.k_norm, heads.kv),
        sinks=None if block.sinks is None else _rows(block.sinks, *heads.q),
    )


def _per_head_norm(norm: Norm | None, heads: tuple[int, int]) -> Norm | None:
    """A per-head norm: one (D,) weight shared by every head stays; (H, D) keeps its rows."""
    if norm is None or norm.weight.dim() == 1:
        return norm
    bias = None if norm.bias is None else _rows(norm.bias, *heads)
    return Norm(norm.spec, _rows(norm.weight, *heads), bias)


def _shard_latent_attention(
    block: LatentAttention, heads: HeadSplit, shard: Shard
) -> LatentAttention:
    s = block.spec
    q_width = s.qk_nope_head_dim + s.qk_rope_head_dim
    q_cols = _head_columns(heads.q, q_width)
    return replace(
        block,
        num_heads=heads.num_heads,
        q=None if block.q is None else _column_linear(block.q, q_cols),
        q_b=None if block.q_b is None else _column_linear(block.q_b, q_cols),
        w_uk=_rows(block.w_uk, *heads.q),
        w_uv=_rows(block.w_uv, *heads.q),
        o=_row_linear(block.o, heads.q[0] * s.v_head_dim, heads.q[1] * s.v_head_dim, shard),
    )


def _shard_mlp(block: MlpBlock, shard: Shard) -> MlpBlock:
    if isinstance(block, DenseMlp):
        return _shard_dense_mlp(block, shard)
    if isinstance(block, SparseMoe):
        shared = None
        if block.shared is not None:
            assert isinstance(block.shared, DenseMlp), "a shared expert is a dense MLP"
            shared = _shard_dense_mlp(block.shared, shard)
        return replace(block, experts=_shard_experts(block.experts, shard), shared=shared)
    raise UnsupportedModelError(f"tensor parallelism cannot split a {type(block).__name__}")


def _shard_dense_mlp(block: DenseMlp, shard: Shard) -> DenseMlp:
    inter = block.spec.intermediate_size
    span = shard.span(inter)
    cols = _gated_columns(inter, span) if block.spec.gated else torch.arange(*span)
    spec = replace(block.spec, intermediate_size=span[1] - span[0])
    return DenseMlp(spec, _column_linear(block.up, cols), _row_linear(block.down, *span, shard))


def _shard_experts(experts: object, shard: Shard) -> RoutedExperts:
    """Plain experts; block FP8, GPTQ, AWQ and compressed-tensors ones on their blocks,
    groups and words (worker/models/quant/sharding.py); others (MXFP4's, refused earlier
    by their method) by name."""
    if isinstance(experts, (Fp8BlockExpertWeights, QuantizedExpertWeights)):
        return experts_shard(experts, shard.span)
    if not isinstance(experts, ExpertWeights):
        raise UnsupportedModelError(
            f"tensor parallelism does not split {type(experts).__name__} experts yet; run it "
            "with tensor_parallel_size 1"
        )
    inter = experts.w2.shape[1]
    span = shard.span(inter)
    cols = _gated_columns(inter, span)
    return replace(
        experts,
        w13=_cols(experts.w13, cols),
        w2=experts.w2[:, span[0] : span[1]].contiguous(),
        b13=None if experts.b13 is None else _cols(experts.b13, cols),
        b2=experts.b2 if shard.rank == 0 else None,
    )


def _experts_on_device(weights: DecoderWeights, device: torch.device, dtype: torch.dtype) -> None:
    """Off the CPU, GPTQ / AWQ / compressed-tensors experts dequantized once after the cut,
    as one GPU's loader does (``quantized_experts.on_device``)."""
    if device.type == "cpu":
        return
    for layer in weights.layers:
        moe = layer.mlp.block if isinstance(layer.mlp, ReducedMlp) else layer.mlp
        if isinstance(moe, SparseMoe) and isinstance(moe.experts, QuantizedExpertWeights):
            moe.experts = on_device(moe.experts, dtype)


def _to_device(value: Any, device: torch.device) -> Any:
    """The shard's modules with every tensor they hold on ``device``."""
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):  # a quantized projection's shape is a meta tensor
        return value if value.device.type == "meta" else value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):  # a quantized projection's parts
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, functools.partial):  # a router rule holding DeepSeek's correction bias
        return functools.partial(
            _to_device(value.func, device),
            *(_to_device(a, device) for a in value.args),
            **{k: _to_device(v, device) for k, v in value.keywords.items()},
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, Shard):
            return value
        changes = {
            f.name: _to_device(getattr(value, f.name), device)
            for f in dataclasses.fields(value)
            if f.init
        }
        return replace(value, **changes)
    return value
