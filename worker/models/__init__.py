"""Model code: the Llama family written once, weights read with safetensors."""

from batchgen.worker.models.llama import LlamaModel
from batchgen.worker.models.model_config import ModelConfig, UnsupportedModelError

__all__ = ["LlamaModel", "ModelConfig", "UnsupportedModelError"]
