"""Building an Engine from a checkpoint directory: device, dtype, model, KV pool."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from batchgen.kernels import select_ops
from batchgen.worker.engine.cuda_graphs import CudaGraphDecoder
from batchgen.worker.engine.kv_cache import allocate_kv_cache, num_blocks_for_budget
from batchgen.worker.engine.runner import ModelRunner
from batchgen.worker.engine.sampler import Sampler
from batchgen.worker.models.config import ModelConfig, UnsupportedModelError, load_model_config
from batchgen.worker.models.llama import LlamaModel
from batchgen.worker.models.loader import load_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedModelError("device cuda asked for, but torch sees no CUDA device")
    return dev


def pick_dtype(dtype: str | None, device: torch.device, config: ModelConfig) -> torch.dtype:
    if dtype is not None:
        if dtype not in _DTYPES:
            raise UnsupportedModelError(f"dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
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


def build_engine(
    cls: Any,
    path: str | os.PathLike[str],
    *,
    device: str | None,
    dtype: str | None,
    block_size: int,
    num_kv_blocks: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    enable_prefix_caching: bool,
    max_model_len: int | None,
    kv_cache_bytes: int | None,
    gpu_memory_utilization: float,
    use_triton: bool | None,
    use_cuda_graphs: bool,
    seed: int | None,
) -> Any:
    from transformers import AutoTokenizer

    from batchgen.worker.engine.engine import EngineLimits

    root = Path(path)
    if not root.is_dir():
        raise UnsupportedModelError(f"model path {path} is not a directory")
    config = load_model_config(root)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev, config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot load the tokenizer from {root}: {exc}") from exc

    limit = config.max_position_embeddings
    if config.sliding_window is not None:
        # within the window sliding attention equals full attention
        limit = min(limit, config.sliding_window)
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise UnsupportedModelError(
            f"max_model_len {max_model_len} exceeds what the model supports ({limit})"
        )
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 4096 if dev.type == "cuda" else 2048
    if block_size < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")

    weights = load_weights(root, config, dev, torch_dtype)
    ops = select_ops(dev, use_triton)
    model = LlamaModel(config, weights, ops, max_model_len, dev)
    if num_kv_blocks is None:
        num_kv_blocks = num_blocks_for_budget(
            config, block_size, torch_dtype, dev, kv_cache_bytes, gpu_memory_utilization
        )
    if num_kv_blocks < 1:
        raise UnsupportedModelError("no memory left for the KV cache; lower the model size")
    kv_caches = allocate_kv_cache(config, num_kv_blocks, block_size, torch_dtype, dev)
    eos = eos_token_ids(root, config, tokenizer)
    graphs = None
    if use_cuda_graphs and dev.type == "cuda" and ops.name == "triton":
        graphs = CudaGraphDecoder(
            model, kv_caches, min(max_num_seqs, 256), max_model_len, block_size, dev
        )
        graphs.capture()
    runner = ModelRunner(model, kv_caches, block_size, Sampler(eos, seed), dev, graphs)
    limits = EngineLimits(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
    )
    return cls(runner, tokenizer, limits, eos, enable_prefix_caching)
