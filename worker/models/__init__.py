"""Model code: one decoder written once, families as switches on it, weights read with safetensors."""

from batchgen.worker.models.causal_lm import CausalLM, ModelShape
from batchgen.worker.models.model_config import ModelConfig
from batchgen.worker.models.registry import build_model, load_model_config
from batchgen.worker.worker_errors import UnsupportedModelError

__all__ = [
    "CausalLM",
    "ModelConfig",
    "ModelShape",
    "UnsupportedModelError",
    "build_model",
    "load_model_config",
]
