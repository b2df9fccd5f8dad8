"""DeepSeek's multi-head latent attention (MLA), with the compressed latent as the KV cache.

transformers expands each token's latent c (kv_lora_rank) into per-head keys
and values with kv_b_proj: k_nope[h] = W_UK[h] c, v[h] = W_UV[h] c. The
expansion is linear, so it moves onto the query and the output instead:

    q_nope[h] . k_nope[h] = (W_UK[h]^T q_nope[h]) . c
    sum_j p_j v_j[h]      = W_UV[h] (sum_j p_j c_j)

and attention runs as MQA over the latent: one KV "head" of dim kv_lora_rank
+ qk_rope_head_dim (the latent and the shared rope key), queries of the same
dim (the absorbed q_nope and the rotated q_pe), values the latent part of the
same rows. The cache holds only that row per token and layer, one tensor read
as keys and as values (``ModelConfig.kv_shared``); the output's rope columns
are dropped before W_UV.

A quantized checkpoint's projections (DeepSeek-V3/R1's block-wise FP8) stay
quantized (``quant.QuantizedLinear``), except kv_b_proj, dequantized once at
load into W_UK and W_UV.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batchgen.kernels.batch import StepAttention
from batchgen.kernels.ops import KernelOps
from batchgen.worker.models.dense_weights import CheckpointLayout
from batchgen.worker.models.layers.norms import Norm
from batchgen.worker.models.layers.rope import RopeTable
from batchgen.worker.models.model_config import (
    LatentAttentionSpec,
    ModelConfig,
    NormKind,
    NormSpec,
)
from batchgen.worker.models.quant import QuantizedLinear, read_quantized
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.models.weights import Linear
from batchgen.worker.worker_errors import UnsupportedModelError

# MLA's projections are read by name, never reordered nor transposed as a family's can be
PLAIN = CheckpointLayout()
# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps,
# not the config's rms_norm_eps
LATENT_NORM = NormSpec(NormKind.RMS, 1e-6)


@dataclass(slots=True)
class LatentAttention:
    spec: LatentAttentionSpec
    num_heads: int
    q: Linear | None  # (hidden, heads * (nope + rope)) when there is no q LoRA
    q_a: Linear | None  # (hidden, q_lora_rank)
    q_a_norm: Norm | None
    q_b: Linear | None  # (q_lora_rank, heads * (nope + rope))
    kv_a: Linear  # (hidden, kv_lora_rank + rope)
    kv_a_norm: Norm  # (kv_lora_rank,)
    w_uk: torch.Tensor  # (heads, nope, kv_lora_rank): q_nope -> the latent query
    w_uv: torch.Tensor  # (heads, kv_lora_rank, v_head_dim): latent output -> values
    o: Linear  # (heads * v_head_dim, hidden)

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
        s, heads, num_tokens = self.spec, self.num_heads, x.shape[0]
        rank, nope, rot = s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim
        if self.q_a is not None and self.q_a_norm is not None and self.q_b is not None:
            q = self.q_b(self.q_a_norm(self.q_a(x), ops))
        else:
            assert self.q is not None
            q = self.q(x)
        q_nope, q_pe = q.view(num_tokens, heads, nope + rot).split([nope, rot], dim=-1)
        latent, k_pe = self.kv_a(x).split([rank, rot], dim=-1)
        latent = self.kv_a_norm(latent, ops)
        assert rope is not None, "MLA always rotates its rope part"
        q_pe, k_pe = ops.apply_rotary(
            q_pe, k_pe.reshape(num_tokens, 1, rot), positions, rope.cos, rope.sin
        )
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # (heads, T, rank)
        query = torch.cat((q_latent.transpose(0, 1), q_pe), dim=-1)  # (T, heads, rank + rot)
        kv = torch.cat((latent, k_pe.reshape(num_tokens, rot)), dim=-1).view(num_tokens, 1, -1)
        out = attend(query, kv, kv, k_cache, v_cache)  # values are the rows too
        out = torch.bmm(out[..., :rank].transpose(0, 1), self.w_uv)  # (heads, T, v_head_dim)
        return self.o(out.transpose(0, 1).reshape(num_tokens, heads * s.v_head_dim))


def read_latent_attention(
    store: TensorStore, config: ModelConfig, p: str, rope_interleaved: bool
) -> LatentAttention:
    """The MLA block of the layer whose tensors start with ``p``; interleaved rope pairs
    (2i, 2i+1) are reordered into the halves the kernels rotate (q.k is unchanged)."""
    s, a = config.latent, config.attention
    assert s is not None
    heads, nope, rot = a.num_heads, s.qk_nope_head_dim, s.qk_rope_head_dim
    attn = p + "self_attn."
    bias = a.qkv_bias

    def linear(name: str, with_bias: bool = False) -> Linear:
        quantized = read_quantized(store, [attn + name], with_bias, PLAIN)
        if quantized is not None:
            return quantized
        weight = store.take(f"{attn}{name}.weight").t().contiguous()
        return Linear(weight, store.take_if(with_bias, f"{attn}{name}.bias"))

    def norm(name: str) -> Norm:
        return Norm(LATENT_NORM, store.take(f"{attn}{name}.weight"))

    q_order = torch.arange(heads * (nope + rot))
    kv_order = torch.arange(s.kv_lora_rank + rot)
    if rope_interleaved:
        pairs = torch.cat((torch.arange(0, rot, 2), torch.arange(1, rot, 2)))
        q_order = q_order.view(heads, nope + rot)
        q_order[:, nope:] = q_order[:, nope:][:, pairs]
        q_order = q_order.flatten()
        kv_order[s.kv_lora_rank :] = kv_order[s.kv_lora_rank :][pairs]
    q = q_a = q_a_norm = q_b = None
    if s.q_lora_rank is None:
        q = _columns(linear("q_proj"), q_order)
    else:
        q_a, q_a_norm = linear("q_a_proj", bias), norm("q_a_layernorm")
        q_b = _columns(linear("q_b_proj"), q_order)
    kv_a = _columns(linear("kv_a_proj_with_mqa", bias), kv_order)
    kv_b = _kv_b(store, f"{attn}kv_b_proj").view(heads, nope + s.v_head_dim, s.kv_lora_rank)
    w_uk = kv_b[:, :nope].contiguous()  # (heads, nope, rank)
    w_uv = kv_b[:, nope:].transpose(1, 2).contiguous()  # (heads, rank, v_head_dim)
    o = linear("o_proj", a.o_bias)
    return LatentAttention(
        s, heads, q, q_a, q_a_norm, q_b, kv_a, norm("kv_a_layernorm"), w_uk, w_uv, o
    )


def _kv_b(store: TensorStore, name: str) -> torch.Tensor:
    """kv_b_proj's (out, in) weight, to be split into W_UK and W_UV per head. A quantized one
    is dequantized here, once, in fp32 and then rounded to the model's dtype as transformers'
    dequantizing loader rounds it: it is small (heads * (nope + v) x kv_lora_rank,
    DeepSeek-V3's 17M of 671B weights)."""
    quantized = read_quantized(store, [name], False, PLAIN)
    if quantized is None:
        return store.take(f"{name}.weight")
    return quantized.dequantized().t().to(store.dtype).contiguous()


def _columns(layer: Linear, order: torch.Tensor) -> Linear:
    if isinstance(layer, QuantizedLinear):
        return _quantized_columns(layer, order)
    order = order.to(layer.weight.device)
    bias = None if layer.bias is None else layer.bias[order].contiguous()
    return Linear(layer.weight[:, order].contiguous(), bias)


def _quantized_columns(layer: QuantizedLinear, order: torch.Tensor) -> QuantizedLinear:
    """The rope pairs' reordering applied to the stored rows of a block-wise FP8 weight, its
    scales as they are: possible where every row stays in its block of rows, as in
    DeepSeek-V3 (a head's 64 rope rows lie in one block of 128)."""
    if torch.equal(order, torch.arange(len(order))):
        return layer
    (part,) = layer.parts
    reordered = part.rows_reordered(order) if isinstance(part, Fp8BlockWeight) else None
    if reordered is None:
        raise UnsupportedModelError(
            "a quantized MLA projection whose interleaved rope rows cross its scale blocks "
            "is not supported (block-wise fp8 with rope rows inside one block is)"
        )
    bias = None if layer.bias is None else layer.bias[order.to(layer.bias.device)].contiguous()
    return replace(layer, bias=bias, parts=(reordered,))
