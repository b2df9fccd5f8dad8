"""Phi (1, 2): attention and MLP in parallel off one LayerNorm, partial rotary, biases
everywhere, a biased LM head. Phi-3: Llama with q/k/v and gate/up each stored as one
matrix, and a sliding window on every layer."""

from __future__ import annotations

import dataclasses

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.dense_weights import CheckpointLayout, weights_for
from batchgen.worker.models.families.decoder_config import (
    Shape,
    Windows,
    decoder_config,
    parallel_block,
)
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import HeadSpec, ModelConfig, NormKind, QKNormScope


def _read_phi(r: ConfigReader, architecture: str) -> ModelConfig:
    qk_norm = QKNormScope.HEAD if r.get("qk_layernorm", False) else None
    shape = Shape(
        qkv_bias=True, o_bias=True, mlp_bias=True, gated_mlp=False, norm=NormKind.LAYER,
        norm_bias=True, norm_eps_key="layer_norm_eps", qk_norm=qk_norm, qk_norm_bias=True,
        block=parallel_block(shared_norm=True),
    )  # fmt: skip
    return dataclasses.replace(decoder_config(r, architecture, shape), head=HeadSpec(bias=True))


def _read_phi3(r: ConfigReader, architecture: str) -> ModelConfig:
    # folded into rope_parameters by transformers where a rope type uses it (longrope)
    r.get("original_max_position_embeddings")
    shape = Shape(qkv_bias=False, o_bias=False, mlp_bias=False, windows=Windows.EVERY_LAYER)
    return decoder_config(r, architecture, shape)


PHI = Family(
    "phi",
    ("PhiForCausalLM",),
    _read_phi,
    weights_for(
        CheckpointLayout(
            o="self_attn.dense", up="mlp.fc1", down="mlp.fc2", final_norm="final_layernorm",
            q_norm="self_attn.q_layernorm", k_norm="self_attn.k_layernorm",
        )
    ),
)  # fmt: skip
PHI3 = Family(
    "phi3",
    ("Phi3ForCausalLM",),
    _read_phi3,
    weights_for(CheckpointLayout(qkv="self_attn.qkv_proj", gate_up="mlp.gate_up_proj")),
)
