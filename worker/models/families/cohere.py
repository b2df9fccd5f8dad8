"""Cohere (Command R): attention and MLP in parallel off one bias-free LayerNorm, rotary on
interleaved pairs, optional per-head q/k LayerNorms, logits scaled by logit_scale."""

from __future__ import annotations

import dataclasses

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.dense_weights import CheckpointLayout, weights_for
from batchgen.worker.models.families.decoder_config import Shape, decoder_config, parallel_block
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import HeadSpec, ModelConfig, NormKind, QKNormScope


def _read_cohere(r: ConfigReader, architecture: str) -> ModelConfig:
    shape = Shape(
        mlp_bias=False, norm=NormKind.LAYER, norm_eps_key="layer_norm_eps",
        qk_norm=QKNormScope.HEAD if r.get("use_qk_norm", False) else None,
        block=parallel_block(shared_norm=True),
    )  # fmt: skip
    config = decoder_config(r, architecture, shape)
    return dataclasses.replace(config, head=HeadSpec(scale=float(r.require("logit_scale"))))


COHERE = Family(
    "cohere",
    ("CohereForCausalLM",),
    _read_cohere,
    weights_for(CheckpointLayout(rope_interleaved=True)),
)
