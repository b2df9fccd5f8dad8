"""The Llama family and what is Llama with switches: Mistral, Qwen2, Qwen3.

``llama_like`` reads the switches these share (sizes, GQA, rotary and its
scaling, windows, biases, q/k norms); other families start from it and
change what differs.
"""

from __future__ import annotations

import enum

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.decoder import DecoderWeights
from batchgen.worker.models.dense_weights import CheckpointLayout, read_dense
from batchgen.worker.models.families import switches
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import (
    AttentionSpec,
    BlockSpec,
    HeadSpec,
    LayerSpec,
    MlpSpec,
    ModelConfig,
    NormKind,
    NormSpec,
    QKNormScope,
    QKNormSpec,
)
from batchgen.worker.models.tensor_store import TensorStore


class Windows(str, enum.Enum):
    NONE = "none"  # the family has no sliding window (a config setting one is refused)
    EVERY_LAYER = "every_layer"  # sliding_window applies to every layer (Mistral, Phi-3)
    LAYER_TYPES = "layer_types"  # to the layers layer_types marks sliding_attention


def llama_like(
    r: ConfigReader,
    architecture: str,
    *,
    qkv_bias: bool | None = None,  # None: attention_bias says (for q/k/v and o alike)
    o_bias: bool | None = None,
    mlp_bias: bool | None = None,  # None: mlp_bias says
    qk_norm: QKNormScope | None = None,
    windows: Windows = Windows.NONE,
    norm_eps_key: str = "rms_norm_eps",
) -> ModelConfig:
    hidden = switches.positive_int(r, "hidden_size")
    num_layers = switches.positive_int(r, "num_hidden_layers")
    num_heads = switches.positive_int(r, "num_attention_heads")
    head_dim = switches.head_dim(r, hidden, num_heads)
    attention_bias = (
        bool(r.get("attention_bias", False)) if qkv_bias is None or o_bias is None else False
    )
    norm = NormSpec(NormKind.RMS, float(r.require(norm_eps_key)))
    ropes, rope_of_type, rotary_dim = switches.ropes(r, head_dim)
    types = (
        switches.layer_types(r, num_layers)
        if windows is Windows.LAYER_TYPES
        else (["full_attention"] * num_layers)
    )
    if windows is Windows.NONE:
        layer_windows: list[int | None] = [None] * num_layers
    else:
        layer_windows = switches.windows(r, types, every_layer=windows is Windows.EVERY_LAYER)
    return ModelConfig(
        architecture=architecture,
        family=r.family,
        vocab_size=switches.positive_int(r, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        max_position_embeddings=switches.context_length(r, ropes),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        torch_dtype=_dtype_name(r),
        norm=norm,
        attention=AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=int(r.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            scale=head_dim**-0.5,
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            qk_norm=None if qk_norm is None else QKNormSpec(qk_norm, norm),
            rotary_dim=rotary_dim,
        ),
        mlp=MlpSpec(
            intermediate_size=switches.positive_int(r, "intermediate_size"),
            activation=switches.activation(r),
            bias=bool(r.get("mlp_bias", False)) if mlp_bias is None else mlp_bias,
        ),
        block=BlockSpec(),
        layers=tuple(
            LayerSpec(window=w, rope=switches.rope_of(rope_of_type, t))
            for w, t in zip(layer_windows, types)
        ),
        ropes=ropes,
        head=HeadSpec(),
        hf_config=r.config.hf,
    )


def _dtype_name(r: ConfigReader) -> str | None:
    dtype = r.get("dtype") or r.get("torch_dtype")
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _read_llama(r: ConfigReader, architecture: str) -> ModelConfig:
    return llama_like(r, architecture)


def _read_mistral(r: ConfigReader, architecture: str) -> ModelConfig:
    return llama_like(r, architecture, qkv_bias=False, o_bias=False, mlp_bias=False,
                      windows=Windows.EVERY_LAYER)  # fmt: skip


def _read_qwen2(r: ConfigReader, architecture: str) -> ModelConfig:
    return llama_like(r, architecture, qkv_bias=True, o_bias=False, mlp_bias=False,
                      windows=Windows.LAYER_TYPES)  # fmt: skip


def _read_qwen3(r: ConfigReader, architecture: str) -> ModelConfig:
    return llama_like(r, architecture, mlp_bias=False, qk_norm=QKNormScope.HEAD,
                      windows=Windows.LAYER_TYPES)  # fmt: skip


def read_llama_weights(store: TensorStore, config: ModelConfig) -> DecoderWeights:
    return read_dense(store, config, CheckpointLayout())


LLAMA = Family("llama", ("LlamaForCausalLM",), _read_llama, read_llama_weights)
MISTRAL = Family("mistral", ("MistralForCausalLM",), _read_mistral, read_llama_weights)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), _read_qwen2, read_llama_weights)
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), _read_qwen3, read_llama_weights)
