"""DeepSeek V2 and V3: multi-head latent attention (MLA) and grouped top-k routing.

Attention is ``latent_attention.py``'s: the cache holds each token's
compressed latent and rope key, one row for every head. The first
``first_k_dense_replace`` layers have a dense MLP; the rest route to experts
(V2: softmax scores, groups scored by their best expert under
"group_limited_greedy"; V3: sigmoid scores with the correction bias on the
choice, groups scored by their two best, weights renormalised), scaled by
``routed_scaling_factor``, plus the shared experts on every token.
"""

from __future__ import annotations

import math
from functools import partial

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.decoder import DecoderWeights
from batchgen.worker.models.dense_weights import CheckpointLayout, read_dense
from batchgen.worker.models.families import switches
from batchgen.worker.models.families.llama_moe import num_experts, read_training_only
from batchgen.worker.models.family import Family
from batchgen.worker.models.layers.latent_attention import LatentAttention, read_latent_attention
from batchgen.worker.models.model_config import (
    AttentionSpec,
    BlockSpec,
    HeadSpec,
    LatentAttentionSpec,
    LayerSpec,
    MlpKind,
    MlpSpec,
    ModelConfig,
    MoeSpec,
    NormKind,
    NormSpec,
    RopeSpec,
    RouterKind,
)
from batchgen.worker.models.moe_weights import MoeLayout, moe_reader
from batchgen.worker.models.tensor_store import TensorStore


def _attention_scale(head_dim: int, rope: RopeSpec) -> float:
    """transformers' yarn_apply_mscale: yarn with mscale_all_dim scales q.k by mscale**2."""
    scale = head_dim**-0.5
    factor, mscale_all_dim = float(rope.get("factor", 1.0)), rope.get("mscale_all_dim", 0)
    if rope.rope_type != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def _expect(r: ConfigReader, key: str, allowed: tuple[object, ...]) -> object:
    """A routing key of DeepSeek's own configs, which transformers' config class may lack."""
    value = r.extra(key, allowed[0])
    if value not in allowed:
        raise r.refuse(key, f"transformers' DeepSeek code computes {', '.join(map(str, allowed))}")
    return value


def _routing(r: ConfigReader, v3: bool, experts: int, inter: int) -> MoeSpec:
    groups, topk_group = int(r.get("n_group") or 1), int(r.get("topk_group") or 1)
    if v3:
        _expect(r, "topk_method", ("noaux_tc",))
        _expect(r, "scoring_func", ("sigmoid",))
        renormalize = bool(r.get("norm_topk_prob", True))
    else:
        method = _expect(r, "topk_method", ("greedy", "group_limited_greedy"))
        _expect(r, "scoring_func", ("softmax",))
        r.get("norm_topk_prob")  # transformers' V2 router never renormalises
        renormalize = False
        if method == "greedy":
            groups = topk_group = 1
    if experts % groups or not 1 <= topk_group <= groups:
        raise r.refuse("n_group", f"{experts} experts in equal groups, topk_group of them kept")
    _expect(r, "moe_layer_freq", (1,))
    read_training_only(r)
    return MoeSpec(
        num_experts=experts,
        top_k=switches.positive_int(r, "num_experts_per_tok"),
        intermediate_size=inter,
        router=RouterKind.GROUPED_TOPK,
        renormalize=renormalize,
        num_groups=groups,
        topk_group=topk_group,
        sigmoid=v3,
        correction_bias=v3,
        scaling_factor=float(r.get("routed_scaling_factor", 1.0)),
        shared_intermediate_size=inter * int(r.get("n_shared_experts") or 0),
    )


def _read_deepseek(r: ConfigReader, architecture: str, v3: bool) -> ModelConfig:
    hidden = switches.positive_int(r, "hidden_size")
    num_layers = switches.positive_int(r, "num_hidden_layers")
    heads = switches.positive_int(r, "num_attention_heads")
    latent = LatentAttentionSpec(
        q_lora_rank=r.get("q_lora_rank"),
        kv_lora_rank=switches.positive_int(r, "kv_lora_rank"),
        qk_nope_head_dim=switches.positive_int(r, "qk_nope_head_dim"),
        qk_rope_head_dim=switches.positive_int(r, "qk_rope_head_dim"),
        v_head_dim=switches.positive_int(r, "v_head_dim"),
    )
    # derived by transformers from the above, or (K/V heads) not used by MLA
    for key in ("qk_head_dim", "head_dim", "num_key_value_heads"):
        r.get(key)
    if v3:
        r.get("num_nextn_predict_layers")  # multi-token prediction layers: not in the forward
        r.get("rope_interleave")  # read below through the layout
    else:
        switches.refuse_if_set(r, "mlp_bias", "MLPs without biases")
    ropes, rope_of_type, rotary_dim = switches.ropes(r, latent.qk_rope_head_dim)
    attention_bias = bool(r.get("attention_bias", False))
    attention = AttentionSpec(
        num_heads=heads,
        num_kv_heads=1,  # the latent row, shared by every head
        head_dim=latent.kv_lora_rank + latent.qk_rope_head_dim,
        scale=_attention_scale(latent.qk_nope_head_dim + latent.qk_rope_head_dim, ropes[0]),
        qkv_bias=attention_bias,  # on q_a_proj and kv_a_proj_with_mqa
        o_bias=attention_bias,
        rotary_dim=rotary_dim,
    )
    inter = switches.positive_int(r, "moe_intermediate_size")
    moe = _routing(r, v3, num_experts(r), inter)
    first_dense = int(r.get("first_k_dense_replace") or 0)
    return ModelConfig(
        architecture=architecture,
        family=r.family,
        vocab_size=switches.positive_int(r, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        max_position_embeddings=switches.context_length(r, ropes),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        torch_dtype=switches.dtype_name(r),
        norm=NormSpec(NormKind.RMS, float(r.require("rms_norm_eps"))),
        attention=attention,
        mlp=MlpSpec(switches.positive_int(r, "intermediate_size"), switches.activation(r)),
        block=BlockSpec(),
        layers=tuple(
            LayerSpec(
                rope=switches.rope_of(rope_of_type, "full_attention"),
                mlp=MlpKind.MOE if i >= first_dense else MlpKind.DENSE,
            )
            for i in range(num_layers)
        ),
        ropes=ropes,
        head=HeadSpec(),
        hf_config=r.config.hf,
        moe=moe,
        latent=latent,
    )


def _read_weights(store: TensorStore, config: ModelConfig, v3: bool) -> DecoderWeights:
    interleaved = not v3 or bool(getattr(config.hf_config, "rope_interleave", True))
    if v3:  # the multi-token prediction layers after the last: transformers skips them too
        extra = int(getattr(config.hf_config, "num_nextn_predict_layers", 0) or 0)
        for i in range(config.num_layers, config.num_layers + extra):
            store.discard_prefix(f"model.layers.{i}.")

    def attention(store: TensorStore, config: ModelConfig, p: str, layer: int) -> LatentAttention:
        return read_latent_attention(store, config, p, interleaved)

    moe = moe_reader(MoeLayout(shared="shared_experts"))
    return read_dense(store, config, CheckpointLayout(), mlp=moe, attention=attention)


DEEPSEEK_V2 = Family(
    "deepseek_v2", ("DeepseekV2ForCausalLM",),
    partial(_read_deepseek, v3=False), partial(_read_weights, v3=False),
)  # fmt: skip
DEEPSEEK_V3 = Family(
    "deepseek_v3", ("DeepseekV3ForCausalLM",),
    partial(_read_deepseek, v3=True), partial(_read_weights, v3=True),
)  # fmt: skip
