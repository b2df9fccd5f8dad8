"""Llama, and what is Llama with switches: Mistral, Qwen2, Qwen3."""

from __future__ import annotations

from batchgen.worker.models.dense_weights import CheckpointLayout, weights_for
from batchgen.worker.models.families.decoder_config import Shape, Windows, reader_for
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import QKNormScope

LLAMA_WEIGHTS = weights_for(CheckpointLayout())

LLAMA = Family("llama", ("LlamaForCausalLM",), reader_for(Shape()), LLAMA_WEIGHTS)
MISTRAL = Family(
    "mistral",
    ("MistralForCausalLM",),
    reader_for(Shape(qkv_bias=False, o_bias=False, mlp_bias=False, windows=Windows.EVERY_LAYER)),
    LLAMA_WEIGHTS,
)
QWEN2 = Family(
    "qwen2",
    ("Qwen2ForCausalLM",),
    reader_for(Shape(qkv_bias=True, o_bias=False, mlp_bias=False, windows=Windows.LAYER_TYPES)),
    LLAMA_WEIGHTS,
)
QWEN3 = Family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    reader_for(Shape(mlp_bias=False, qk_norm=QKNormScope.HEAD, windows=Windows.LAYER_TYPES)),
    LLAMA_WEIGHTS,
)
