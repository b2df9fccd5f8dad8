"""Reading a dense decoder's tensors, whatever a family calls them, into the decoder's modules.

A family says where its tensors are (``CheckpointLayout``: names, and how its
fused or transposed tensors are laid out) and its ``ModelConfig`` says which
exist (biases, norms, q/k norms); ``read_dense`` takes exactly those from the
store, so a tensor the config does not account for stays behind and the load
is refused (``TensorStore.check_all_taken``). On a tensor-parallel rank it asks
for the projections, embedding and LM head as their ``Split``s, so the store
reads only this rank's slice of each (worker/models/tensor_shard.py says which,
and which tensors are read whole).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.worker.models.decoder import DecoderLayer, DecoderWeights
from batchgen.worker.models.layers.mlp import DenseMlp
from batchgen.worker.models.layers.norms import Norm
from batchgen.worker.models.layers.self_attention import SelfAttention
from batchgen.worker.models.model_config import (
    BlockKind,
    MlpKind,
    ModelConfig,
    NormSpec,
    QKNormScope,
)
from batchgen.worker.models.quant import read_quantized
from batchgen.worker.models.tensor_shard import Split
from batchgen.worker.models.tensor_store import Slice, TensorStore
from batchgen.worker.models.weights import Linear, fuse


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """Module names (a tensor is NAME.weight / NAME.bias) and layout quirks. Layer
    names are relative to ``{prefix}{layers}.{i}.``."""

    prefix: str = "model."
    embed: str = "embed_tokens"
    layers: str = "layers"
    final_norm: str = "norm"
    lm_head: str = "lm_head"  # not under prefix
    position_embed: str | None = None
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    post_attn_norm: str = "post_attention_layernorm"
    post_mlp_norm: str = "post_feedforward_layernorm"
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    qkv: str | None = None  # one fused projection, q then k then v (Phi-3)
    qkv_per_head: bool = False  # fused as (heads, q/k/v, head_dim) (GPT-NeoX)
    o: str = "self_attn.o_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    qk_norm_modules: bool = False  # one norm module per head: NAME.norms.{h}.weight (StableLM)
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"  # plain MLPs: fc1
    gate_up: str | None = None  # gate and up fused (Phi-3, GLM)
    down: str = "mlp.down_proj"  # plain MLPs: fc2
    transposed: bool = False  # weights stored (in, out) (GPT-2's Conv1D)
    norm_offset: float = 0.0  # the norm scales by (offset + weight) (Gemma: 1)
    rope_interleaved: bool = False  # rotary pairs (2i, 2i+1) rather than (i, i + d/2)
    sinks: str = "self_attn.sinks"  # (heads,) sink logits, where the config has them


# (store, config, layer prefix, layer index) -> that layer's block, for the layers a
# family builds itself: an MoE family's expert MLPs, MLA attention
BlockReader = Callable[[TensorStore, ModelConfig, str, int], Any]


def read_dense(
    store: TensorStore,
    config: ModelConfig,
    layout: CheckpointLayout,
    *,
    mlp: BlockReader | None = None,
    attention: BlockReader | None = None,
) -> DecoderWeights:
    """Every tensor of the layout; ``mlp`` builds the MLP of each layer whose
    ``LayerSpec.mlp`` is not dense, ``attention`` every layer's attention."""
    reader = _Reader(store, config, layout, mlp, attention)
    cut = store.cut_layer or (lambda layer: layer)
    layers = [
        cut(reader.layer(f"{layout.prefix}{layout.layers}.{i}.", i))
        for i in range(config.num_layers)
    ]
    embed = store.take(f"{layout.prefix}{layout.embed}.weight", part=reader.part(Split.VOCAB))
    position_embed = None
    if config.learned_positions and layout.position_embed is not None:
        position_embed = store.take(f"{layout.prefix}{layout.position_embed}.weight")
    final_norm = reader.norm(layout.prefix + layout.final_norm, config.norm)
    return DecoderWeights(embed, layers, final_norm, reader.lm_head(embed), position_embed)


def weights_for(layout: CheckpointLayout) -> Callable[[TensorStore, ModelConfig], DecoderWeights]:
    """A family's weight mapping that is ``read_dense`` with its layout."""

    def read(store: TensorStore, config: ModelConfig) -> DecoderWeights:
        return read_dense(store, config, layout)

    return read


@dataclass(slots=True)
class _Reader:
    store: TensorStore
    config: ModelConfig
    layout: CheckpointLayout
    mlp_reader: BlockReader | None = None
    attention_reader: BlockReader | None = None

    def part(self, split: Split | None, weight: bool = False) -> Slice | None:
        """This rank's part of a ``split`` tensor (None: all of it); a weight's as stored."""
        if split is None or self.store.slices is None:
            return None
        part = self.store.slices.of(split)
        return part.transposed() if weight and self.layout.transposed else part

    def linear(self, name: str, bias: bool, split: Split | None = None) -> Linear:
        return self.fused([name], bias, [split])

    def fused(
        self, names: list[str], bias: bool, splits: list[Split | None] | None = None
    ) -> Linear:
        """The projections ``names`` side by side; on a rank, ``splits`` their parts."""
        quantized = read_quantized(self.store, names, bias, self.layout)
        if quantized is not None:
            return quantized
        splits = splits or [None] * len(names)
        take = self.store.take
        weights = [take(f"{n}.weight", part=self.part(s, True)) for n, s in zip(names, splits)]
        if self.layout.transposed:
            weights = [w.t() for w in weights]
        biases = []
        for n, s in zip(names, splits) if bias else ():
            part = self.part(s)  # a column-parallel bias is split like its rows; else whole
            biases.append(take(f"{n}.bias", part=part if part and part.dim == 0 else None))
        return fuse(weights, biases)

    def norm(self, name: str, spec: NormSpec) -> Norm:
        weight = self.store.take(f"{name}.weight", float32=True)
        weight = (weight + self.layout.norm_offset).to(self.store.dtype)
        return Norm(spec, weight, self.store.take_if(spec.bias, f"{name}.bias"))

    def layer(self, p: str, i: int) -> DecoderLayer:
        cfg, lay, block = self.config, self.layout, self.config.block
        if self.attention_reader is not None:
            attention = self.attention_reader(self.store, cfg, p, i)
        else:
            attention = self.self_attention(p)
        if cfg.layers[i].mlp is MlpKind.DENSE:
            mlp = self.dense_mlp(p)
        else:
            assert self.mlp_reader is not None, f"no reader for {cfg.layers[i].mlp} MLPs"
            mlp = self.mlp_reader(self.store, cfg, p, i)
        pre, post = block.pre_norms, block.post_norms
        shared = block.kind is BlockKind.PARALLEL and block.shared_norm
        return DecoderLayer(
            attention,
            mlp,
            attn_norm=self.norm(p + lay.attn_norm, cfg.norm) if pre else None,
            mlp_norm=self.norm(p + lay.mlp_norm, cfg.norm) if pre and not shared else None,
            post_attn_norm=self.norm(p + lay.post_attn_norm, cfg.norm) if post else None,
            post_mlp_norm=self.norm(p + lay.post_mlp_norm, cfg.norm) if post else None,
        )

    def self_attention(self, p: str) -> SelfAttention:
        a, lay = self.config.attention, self.layout
        attention = SelfAttention(a, self.qkv(p), self.linear(p + lay.o, a.o_bias, Split.OUT))
        if a.qk_norm is not None:
            attention.q_norm = self.qk_norm(p + lay.q_norm, a.num_heads)
            attention.k_norm = self.qk_norm(p + lay.k_norm, a.num_kv_heads)
        if a.sinks:
            attention.sinks = self.store.take(p + lay.sinks, float32=True)
        return attention

    def dense_mlp(self, p: str) -> DenseMlp:
        m, lay = self.config.mlp, self.layout
        if m.gated and lay.gate_up is not None:
            up = self.linear(p + lay.gate_up, m.bias, Split.GATE_UP)
        elif m.gated:
            up = self.fused([p + lay.gate, p + lay.up], m.bias, [Split.INTER, Split.INTER])
        else:
            up = self.linear(p + lay.up, m.bias, Split.INTER)
        return DenseMlp(m, up, self.linear(p + lay.down, m.bias, Split.DOWN))

    def qkv(self, p: str) -> Linear:
        a, lay = self.config.attention, self.layout
        whole = lay.qkv_per_head or lay.rope_interleaved  # reordered at load: read whole
        if lay.qkv is None:
            splits: list[Split | None] | None = None if whole else [Split.Q, Split.KV, Split.KV]
            qkv = self.fused([p + lay.q, p + lay.k, p + lay.v], a.qkv_bias, splits)
        else:
            qkv = self.linear(p + lay.qkv, a.qkv_bias, None if whole else Split.QKV)
            if lay.qkv_per_head:
                qkv = _heads_to_blocks(qkv, a.num_heads, a.head_dim)
        if lay.rope_interleaved:
            qkv = _deinterleave_rotary(qkv, a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim)
        return qkv

    def qk_norm(self, name: str, heads: int) -> Norm:
        a, lay = self.config.attention, self.layout
        assert a.qk_norm is not None
        spec = a.qk_norm.norm
        if lay.qk_norm_modules:
            norms = [self.norm(f"{name}.norms.{h}", spec) for h in range(heads)]
            weight = torch.stack([n.weight for n in norms])
            bias = torch.stack([n.bias for n in norms if n.bias is not None]) if spec.bias else None
            norm = Norm(spec, weight, bias)
        else:
            norm = self.norm(name, spec)
        if lay.rope_interleaved:
            if a.qk_norm.scope is QKNormScope.ALL:
                raise ValueError("interleaved rotary with a whole-projection q/k norm")
            order = _rotary_order(a.head_dim, a.rotary_dim)
            norm.weight = norm.weight[..., order].contiguous()
            if norm.bias is not None:
                norm.bias = norm.bias[..., order].contiguous()
        return norm

    def lm_head(self, embed: torch.Tensor) -> Linear:
        cfg, name = self.config, self.layout.lm_head
        bias = self.store.take_if(cfg.head.bias, f"{name}.bias")
        part = self.part(Split.VOCAB)
        if not cfg.tie_word_embeddings:
            return Linear(self.store.take(f"{name}.weight", part=part).t().contiguous(), bias)
        if self.store.has(f"{name}.weight") and not torch.equal(
            self.store.take(f"{name}.weight", part=part), embed
        ):
            self.store.refuse(f"{name}.weight", "tie_word_embeddings is set, yet it differs")
        # a copy is worth its memory on the CPU; CUDA's matmuls take the transposed view as fast
        return Linear(embed.t().contiguous() if embed.device.type == "cpu" else embed.t(), bias)


def _heads_to_blocks(qkv: Linear, heads: int, dim: int) -> Linear:
    """Columns laid out (head, q/k/v, dim) -> (q/k/v, head, dim)."""

    def reorder(t: torch.Tensor) -> torch.Tensor:
        lead = t.shape[:-1]
        return t.view(*lead, heads, 3, dim).transpose(-3, -2).reshape(*lead, 3 * heads * dim)

    bias = None if qkv.bias is None else reorder(qkv.bias)
    return Linear(reorder(qkv.weight).contiguous(), bias)


def _rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The channel order that makes interleaved rotary pairs (2i, 2i+1) the halves
    (i, i + rotary_dim/2) the kernels rotate; q.k is the same in either order."""
    evens = torch.arange(0, rotary_dim, 2)
    return torch.cat([evens, evens + 1, torch.arange(rotary_dim, head_dim)])


def _deinterleave_rotary(qkv: Linear, heads: int, kv_heads: int, dim: int, rotary: int) -> Linear:
    order = _rotary_order(dim, rotary)
    q_cols = (torch.arange(heads)[:, None] * dim + order).flatten()
    k_cols = heads * dim + (torch.arange(kv_heads)[:, None] * dim + order).flatten()
    v_cols = torch.arange((heads + kv_heads) * dim, (heads + 2 * kv_heads) * dim)
    cols = torch.cat([q_cols, k_cols, v_cols]).to(qkv.weight.device)
    bias = None if qkv.bias is None else qkv.bias[cols].contiguous()
    return Linear(qkv.weight[:, cols].contiguous(), bias)
