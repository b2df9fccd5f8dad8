"""From a checkpoint directory to the family that runs it natively, and its config read.

``load_model_config`` refuses what no native family reads (architecture,
switch, value) with the reason; ``build_model`` reads the weights, refusing
any tensor left unread, and returns the decoder.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from batchgen.kernels.ops import KernelOps
from batchgen.worker.models.causal_lm import CausalLM
from batchgen.worker.models.config_keys import ConfigReader, check_all_read
from batchgen.worker.models.decoder import Decoder
from batchgen.worker.models.families.cohere import COHERE
from batchgen.worker.models.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from batchgen.worker.models.families.gemma import GEMMA, GEMMA2, GEMMA3
from batchgen.worker.models.families.glm import GLM, GLM4
from batchgen.worker.models.families.gpt2 import GPT2, STARCODER2
from batchgen.worker.models.families.gpt_neox import GPT_NEOX, STABLELM
from batchgen.worker.models.families.gpt_oss import GPT_OSS
from batchgen.worker.models.families.granite import GRANITE
from batchgen.worker.models.families.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from batchgen.worker.models.families.llama_moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from batchgen.worker.models.families.olmo import EXAONE4, OLMO2, OLMO3
from batchgen.worker.models.families.phi import PHI, PHI3
from batchgen.worker.models.families.smollm3 import SMOLLM3
from batchgen.worker.models.family import Family
from batchgen.worker.models.hf_config import HFConfig, read_hf_config
from batchgen.worker.models.loader import read_checkpoint
from batchgen.worker.models.model_config import ModelConfig
from batchgen.worker.models.quant import read_quantization
from batchgen.worker.worker_errors import UnsupportedModelError

# every family batchgen runs natively
FAMILIES: tuple[Family, ...] = (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3, PHI, PHI3, GPT_NEOX, STABLELM,
    GRANITE, COHERE, OLMO2, OLMO3, EXAONE4, SMOLLM3, GLM, GLM4, GPT2, STARCODER2,
    MIXTRAL, QWEN2_MOE, QWEN3_MOE, GPT_OSS, DEEPSEEK_V2, DEEPSEEK_V3,
)  # fmt: skip
BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}


def native_architectures() -> list[str]:
    return sorted(BY_ARCHITECTURE)


def find_family(config: HFConfig) -> tuple[str, Family] | None:
    """The first of the config's architectures a native family reads, and that family."""
    for architecture in config.architectures:
        family = BY_ARCHITECTURE.get(architecture)
        if family is not None:
            return architecture, family
    return None


def read_native_config(config: HFConfig) -> ModelConfig:
    found = find_family(config)
    if found is None:
        archs = ", ".join(config.architectures) or "(none given)"
        raise UnsupportedModelError(
            f"architecture {archs} in {config.path} is not supported; batchgen runs "
            f"{', '.join(native_architectures())}"
        )
    architecture, family = found
    reader = ConfigReader(config, family.name)
    model_config = family.read_config(reader, architecture)
    quantization = read_quantization(reader.extra("quantization_config"))
    check_all_read(reader)
    return replace(model_config, quantization=quantization)


def load_model_config(path: str | Path) -> ModelConfig:
    """Reads config.json and checks a native family honours every switch it sets."""
    return read_native_config(read_hf_config(path))


def build_model(
    path: str | Path,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    ops: KernelOps,
    max_positions: int,
) -> CausalLM:
    """The native decoder with the checkpoint's weights; every tensor must be used."""
    family = BY_NAME[config.family]
    store = read_checkpoint(Path(path), device, dtype)
    store.quantization = config.quantization
    store.gemms = ops.quant_gemms
    weights = family.read_weights(store, config)
    store.check_all_taken(family.name)
    return Decoder(config, weights, ops, max_positions, device)
