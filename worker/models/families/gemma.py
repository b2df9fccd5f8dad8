"""Gemma 1, 2 and 3: norms that scale by (1 + w), embeddings scaled by sqrt(hidden), GELU-tanh;
Gemma 2 and 3 add post-norms, query_pre_attn_scalar and local/global layers; Gemma 2
soft-caps attention scores and logits; Gemma 3 normalises q and k and gives its local
layers their own rotary base."""

from __future__ import annotations

import dataclasses

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.dense_weights import CheckpointLayout, weights_for
from batchgen.worker.models.families import switches
from batchgen.worker.models.families.decoder_config import Shape, Windows, decoder_config
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import BlockSpec, HeadSpec, ModelConfig, QKNormScope


def _gemma_like(r: ConfigReader, architecture: str, shape: Shape) -> ModelConfig:
    switches.refuse_if_set(
        r, "use_bidirectional_attention", "bidirectional attention is an encoder's, not a decoder's"
    )
    config = decoder_config(r, architecture, shape)
    return dataclasses.replace(config, embedding_scale=config.hidden_size**0.5)


def _read_gemma(r: ConfigReader, architecture: str) -> ModelConfig:
    return _gemma_like(r, architecture, Shape(mlp_bias=False))


def _read_gemma2(
    r: ConfigReader, architecture: str, qk_norm: QKNormScope | None = None
) -> ModelConfig:
    shape = Shape(
        mlp_bias=False,
        act_key="hidden_activation",
        windows=Windows.LAYER_TYPES,
        qk_norm=qk_norm,
        block=BlockSpec(post_norms=True),
    )
    config = _gemma_like(r, architecture, shape)
    scalar = float(r.require("query_pre_attn_scalar"))
    attention = dataclasses.replace(
        config.attention, scale=scalar**-0.5, softcap=r.get("attn_logit_softcapping")
    )
    head = HeadSpec(softcap=r.get("final_logit_softcapping"))
    return dataclasses.replace(config, attention=attention, head=head)


def _read_gemma3(r: ConfigReader, architecture: str) -> ModelConfig:
    return _read_gemma2(r, architecture, qk_norm=QKNormScope.HEAD)


GEMMA_LAYOUT = CheckpointLayout(
    norm_offset=1.0,
    mlp_norm="pre_feedforward_layernorm",
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)
GEMMA = Family(
    "gemma",
    ("GemmaForCausalLM",),
    _read_gemma,
    weights_for(CheckpointLayout(norm_offset=1.0)),
)
GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), _read_gemma2, weights_for(GEMMA_LAYOUT))
GEMMA3 = Family("gemma3_text", ("Gemma3ForCausalLM",), _read_gemma3, weights_for(GEMMA_LAYOUT))
