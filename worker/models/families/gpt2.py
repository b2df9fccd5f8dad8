"""GPT-2 and StarCoder2: LayerNorms with biases and a plain (ungated) MLP. GPT-2 adds learned
positions instead of rotary and stores its projections input-major (Conv1D); StarCoder2 has
a sliding window on every layer."""

from __future__ import annotations

import dataclasses

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.decoder import DecoderWeights
from batchgen.worker.models.dense_weights import CheckpointLayout, read_dense
from batchgen.worker.models.families import switches
from batchgen.worker.models.families.decoder_config import Shape, Windows, decoder_config
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import ModelConfig, NormKind
from batchgen.worker.models.tensor_store import TensorStore


def _read_gpt2(r: ConfigReader, architecture: str) -> ModelConfig:
    switches.refuse_if_set(
        r, "scale_attn_by_inverse_layer_idx", "a scale per layer is not implemented"
    )
    switches.refuse_if_set(r, "reorder_and_upcast_attn", "its reordered half-precision math")
    shape = Shape(
        qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False, norm=NormKind.LAYER,
        norm_bias=True, norm_eps_key="layer_norm_epsilon", act_key="activation_function",
        intermediate_key="n_inner", rope=False,
    )  # fmt: skip
    config = decoder_config(r, architecture, shape)
    scale = config.attention.scale if r.get("scale_attn_weights", True) else 1.0
    return dataclasses.replace(
        config,
        learned_positions=True,
        attention=dataclasses.replace(config.attention, scale=scale),
    )


GPT2_LAYOUT = CheckpointLayout(
    prefix="transformer.", embed="wte", position_embed="wpe", layers="h", final_norm="ln_f",
    attn_norm="ln_1", mlp_norm="ln_2", qkv="attn.c_attn", o="attn.c_proj", up="mlp.c_fc",
    down="mlp.c_proj", transposed=True,
)  # fmt: skip


def _read_gpt2_weights(store: TensorStore, config: ModelConfig) -> DecoderWeights:
    for i in range(config.num_layers):  # causal-mask buffers of old checkpoints
        store.discard(f"transformer.h.{i}.attn.bias")
        store.discard(f"transformer.h.{i}.attn.masked_bias")
    return read_dense(store, config, GPT2_LAYOUT)


def _read_starcoder2(r: ConfigReader, architecture: str) -> ModelConfig:
    bias = bool(r.get("use_bias", True))
    shape = Shape(
        qkv_bias=bias, o_bias=bias, mlp_bias=bias, gated_mlp=False, norm=NormKind.LAYER,
        norm_bias=True, norm_eps_key="norm_epsilon", windows=Windows.EVERY_LAYER,
    )  # fmt: skip
    return decoder_config(r, architecture, shape)


GPT2 = Family("gpt2", ("GPT2LMHeadModel",), _read_gpt2, _read_gpt2_weights)
STARCODER2 = Family(
    "starcoder2",
    ("Starcoder2ForCausalLM",),
    _read_starcoder2,
    lambda store, config: read_dense(
        store, config, CheckpointLayout(up="mlp.c_fc", down="mlp.c_proj")
    ),
)
