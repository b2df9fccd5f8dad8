"""Granite: Llama with multipliers on the embeddings, the residual branches, the attention
scores (in place of 1/sqrt(head_dim)) and the logits."""

from __future__ import annotations

import dataclasses

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.families.decoder_config import Shape, decoder_config
from batchgen.worker.models.families.llama import LLAMA_WEIGHTS
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import HeadSpec, ModelConfig


def _read_granite(r: ConfigReader, architecture: str) -> ModelConfig:
    config = decoder_config(r, architecture, Shape())
    return dataclasses.replace(
        config,
        embedding_scale=float(r.require("embedding_multiplier")),
        block=dataclasses.replace(
            config.block, residual_multiplier=float(r.require("residual_multiplier"))
        ),
        attention=dataclasses.replace(
            config.attention, scale=float(r.require("attention_multiplier"))
        ),
        head=HeadSpec(scale=1.0 / float(r.require("logits_scaling"))),
    )


GRANITE = Family("granite", ("GraniteForCausalLM",), _read_granite, LLAMA_WEIGHTS)
