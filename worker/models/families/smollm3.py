"""SmolLM3: Llama whose layers no_rope_layers marks 0 have no rotary (NoPE)."""

from __future__ import annotations

import dataclasses

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.families.decoder_config import Shape, Windows, decoder_config
from batchgen.worker.models.families.llama import LLAMA_WEIGHTS
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import ModelConfig


def _read_smollm3(r: ConfigReader, architecture: str) -> ModelConfig:
    config = decoder_config(r, architecture, Shape(windows=Windows.LAYER_TYPES))
    r.read.add("no_rope_layer_interval")  # transformers derives no_rope_layers from it
    uses_rope = list(r.require("no_rope_layers"))
    if len(uses_rope) != config.num_layers or any(u not in (0, 1) for u in uses_rope):
        raise r.refuse("no_rope_layers", f"{config.num_layers} flags of 0 or 1")
    layers = tuple(
        layer if use else dataclasses.replace(layer, rope=None)
        for layer, use in zip(config.layers, uses_rope)
    )
    return dataclasses.replace(config, layers=layers)


SMOLLM3 = Family("smollm3", ("SmolLM3ForCausalLM",), _read_smollm3, LLAMA_WEIGHTS)
