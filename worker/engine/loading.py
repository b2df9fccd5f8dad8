"""Loading what an Engine runs from a checkpoint directory: device, dtype, model, KV pool."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchgen.jobs.schema.errors import ModelNotLoadable
from batchgen.jobs.schema.model_files import check_checkpoint
from batchgen.kernels import select_ops
from batchgen.worker.engine.cuda_graphs import CudaGraphDecoder
from batchgen.worker.engine.kv_cache import allocate_kv_cache, num_blocks_for_budget
from batchgen.worker.engine.model_runner import ModelRunner
from batchgen.worker.engine.pooling import load_pooling
from batchgen.worker.engine.sampler import Sampler
from batchgen.worker.engine_config import DTYPES, EngineConfig
from batchgen.worker.models import (
    ModelConfig,
    UnsupportedModelError,
    build_model,
    load_model_config,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_DTYPES = {name: getattr(torch, name) for name in DTYPES}


@dataclass(slots=True)
class EngineLimits:
    """The engine's sizes, resolved against the model and the device."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int


@dataclass(slots=True)
class LoadedEngine:
    runner: ModelRunner
    tokenizer: PreTrainedTokenizerBase
    limits: EngineLimits
    eos_token_ids: tuple[int, ...]


def pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedModelError("device cuda asked for, but torch sees no CUDA device")
    return dev


def pick_dtype(dtype: str | None, device: torch.device, config: ModelConfig) -> torch.dtype:
    if dtype is not None:
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if config.torch_dtype in ("float16", "bfloat16"):
        return _DTYPES[config.torch_dtype]
    return torch.bfloat16


def eos_token_ids(path: Path, config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """generation_config.json's EOS list, else the model config's, else the tokenizer's."""
    candidates: Any = None
    gen = path / "generation_config.json"
    if gen.is_file():
        candidates = json.loads(gen.read_text()).get("eos_token_id")
    if candidates is None:
        candidates = getattr(config.hf_config, "eos_token_id", None)
    if candidates is None:
        candidates = tokenizer.eos_token_id
    if candidates is None:
        return ()
    if isinstance(candidates, int):
        return (candidates,)
    return tuple(int(c) for c in candidates)


def build_engine(path: str | os.PathLike[str], config: EngineConfig) -> LoadedEngine:
    """Tokenizer, model, KV pool, CUDA graphs, pooling and runner for ``path`` as ``config`` says."""
    from transformers import AutoTokenizer

    try:
        root = check_checkpoint(path)  # its files, before any of them is read
    except ModelNotLoadable as exc:
        raise UnsupportedModelError(str(exc)) from None
    model_config = load_model_config(root)
    dev = pick_device(config.device)
    torch_dtype = pick_dtype(config.dtype, dev, model_config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot load the tokenizer from {root}: {exc}") from exc

    limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise UnsupportedModelError(
            f"max_model_len {max_model_len} exceeds what the model supports ({limit})"
        )
    max_num_batched_tokens = config.max_num_batched_tokens or (4096 if dev.type == "cuda" else 2048)
    block_size, max_num_seqs = config.block_size, config.max_num_seqs

    ops = select_ops(dev, config.use_triton)
    a = model_config.attention
    problem = ops.attention_limits(a.num_heads, a.num_kv_heads, a.head_dim)
    if problem is not None:
        raise UnsupportedModelError(f"{model_config.family} on the {ops.name} kernels: {problem}")
    model = build_model(root, model_config, dev, torch_dtype, ops, max_model_len)
    num_kv_blocks = config.num_kv_blocks or num_blocks_for_budget(
        model_config, block_size, torch_dtype, dev, config.kv_cache_bytes,
        config.gpu_memory_utilization,
    )  # fmt: skip
    if num_kv_blocks < 1:
        raise UnsupportedModelError("no memory left for the KV cache; lower the model size")
    kv_caches = allocate_kv_cache(model_config, num_kv_blocks, block_size, torch_dtype, dev)
    eos = eos_token_ids(root, model_config, tokenizer)
    graphs = None
    if config.use_cuda_graphs and dev.type == "cuda" and ops.name == "triton":
        graphs = CudaGraphDecoder(
            model, kv_caches, min(max_num_seqs, 256), max_model_len, block_size, dev
        )
        graphs.capture()
    runner = ModelRunner(
        model, kv_caches, block_size, Sampler(eos, config.seed), dev, graphs, load_pooling(root)
    )
    limits = EngineLimits(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
    )
    return LoadedEngine(runner, tokenizer, limits, eos)
