"""OLMo 2 and 3, and EXAONE 4: norms after attention and the MLP instead of before, and q/k
norms (over the whole projection in OLMo, per head in EXAONE). OLMo 3 and EXAONE 4 mix
sliding-window and global layers; EXAONE 4's global layers then have no rotary."""

from __future__ import annotations

import dataclasses

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.dense_weights import CheckpointLayout, weights_for
from batchgen.worker.models.families.decoder_config import (
    Shape,
    Windows,
    decoder_config,
    reader_for,
)
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import BlockSpec, ModelConfig, QKNormScope

POST_NORMS = BlockSpec(pre_norms=False, post_norms=True)


def _read_exaone4(r: ConfigReader, architecture: str) -> ModelConfig:
    shape = Shape(
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=QKNormScope.HEAD,
        windows=Windows.LAYER_TYPES, block=POST_NORMS,
    )  # fmt: skip
    config = decoder_config(r, architecture, shape)
    if r.get("sliding_window") is None:
        return config
    # with a window configured, only the sliding layers rotate (transformers' Exaone4Attention)
    layers = tuple(
        dataclasses.replace(layer, rope=None) if layer.window is None else layer
        for layer in config.layers
    )
    return dataclasses.replace(config, layers=layers)


OLMO_WEIGHTS = weights_for(CheckpointLayout())
OLMO2 = Family(
    "olmo2",
    ("Olmo2ForCausalLM",),
    reader_for(Shape(mlp_bias=False, qk_norm=QKNormScope.ALL, block=POST_NORMS)),
    OLMO_WEIGHTS,
)
OLMO3 = Family(
    "olmo3",
    ("Olmo3ForCausalLM",),
    reader_for(
        Shape(
            mlp_bias=False, qk_norm=QKNormScope.ALL, windows=Windows.LAYER_TYPES,
            block=POST_NORMS,
        )
    ),
    OLMO_WEIGHTS,
)  # fmt: skip
EXAONE4 = Family("exaone4", ("Exaone4ForCausalLM",), _read_exaone4, OLMO_WEIGHTS)
