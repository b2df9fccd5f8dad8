"""A model family: the HF architectures it reads, its config reader and its weight mapping.

The decoder is shared; a family only says how its config's switches map onto
``ModelConfig`` and where its tensors are. Families are listed in
``families/__init__.py``; ``registry.py`` looks them up by architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.decoder import DecoderWeights
from batchgen.worker.models.model_config import ModelConfig
from batchgen.worker.models.tensor_store import TensorStore


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # as ModelConfig.family and in messages, e.g. "gemma2"
    architectures: tuple[str, ...]  # the HF classes it reads, e.g. ("Gemma2ForCausalLM",)
    # (reader, architecture) -> the switches; reads every key it honours through the reader
    read_config: Callable[[ConfigReader, str], ModelConfig]
    # takes every tensor the model uses from the store, as the config says they exist
    read_weights: Callable[[TensorStore, ModelConfig], DecoderWeights]
