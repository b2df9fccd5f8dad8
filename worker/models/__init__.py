"""Model code: the Llama family written once, weights read with safetensors."""

from batchgen.worker.models.config import ModelConfig, UnsupportedModelError
from batchgen.worker.models.llama import LlamaModel

__all__ = ["LlamaModel", "ModelConfig", "UnsupportedModelError"]
