"""Loading what an Engine runs from a checkpoint directory: device, dtype, model, KV pool."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchgen.jobs.schema.errors import ModelNotLoadable
from batchgen.jobs.schema.model_files import check_config, check_files
from batchgen.kernels.ops import KernelOps, select_ops
from batchgen.openmp_waits import wait_policy_missed
from batchgen.worker.cpu_threads import ContentionWatch, choose_threads, usable_cpus
from batchgen.worker.engine.runner.cuda_graphs import CudaGraphDecoder
from batchgen.worker.engine.runner.kv_cache import allocate_kv_cache, num_blocks_for_budget
from batchgen.worker.engine.runner.model_runner import ModelRunner
from batchgen.worker.engine.runner.pooling import load_pooling
from batchgen.worker.engine.runner.sampler import Sampler
from batchgen.worker.engine.runner.warmup import warm_up_prefill
from batchgen.worker.engine.tensor_group import Collectives, TensorGroup, rank_device
from batchgen.worker.engine_config import DTYPES, EngineConfig
from batchgen.worker.models import CausalLM, ModelConfig, UnsupportedModelError, build_model
from batchgen.worker.models.hf_backend import HfCausalLM
from batchgen.worker.models.hf_config import HFConfig, read_hf_config
from batchgen.worker.models.implementation import Implementation, choose_implementation
from batchgen.worker.models.quant.online import quantized_at_load, summary
from batchgen.worker.models.tensor_parallel import ShardedDecoder, build_sharded_model
from batchgen.worker.models.tensor_shard import check_shardable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
_DTYPES = {name: getattr(torch, name) for name in DTYPES}


@dataclass(slots=True)
class EngineLimits:
    """The engine's sizes, resolved against the model and the device."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    threads: int  # torch's CPU threads, as the engine set them


@dataclass(slots=True)
class LoadedEngine:
    runner: ModelRunner
    tokenizer: PreTrainedTokenizerBase
    limits: EngineLimits
    eos_token_ids: tuple[int, ...]
    enable_prefix_caching: bool  # as asked, unless the model keeps a state per sequence


def pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedModelError("device cuda asked for, but torch sees no CUDA device")
    return dev


def pick_dtype(dtype: str | None, device: torch.device, saved: str | None) -> torch.dtype:
    """The asked dtype, else fp32 on CPU, else the checkpoint's half type (``saved``) or bf16."""
    if dtype is not None:
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if saved in ("float16", "bfloat16"):
        return _DTYPES[saved]
    return torch.bfloat16


def set_threads(asked: int | None, device: torch.device, ranks: int = 1) -> int:
    """Sets torch's CPU threads for the engine (``cpu_threads.choose_threads``):
    on CPU, and on CUDA only when asked; a tensor-parallel group's ``ranks`` share the
    usable CPUs. Returns the count."""
    current = torch.get_num_threads()
    if device.type != "cpu" and asked is None:
        return current
    usable = usable_cpus()
    threads = choose_threads(asked, current, max(1, usable // ranks))
    if threads != current:
        torch.set_num_threads(threads)
    log.info("%d CPU threads (%d usable CPUs)", threads, usable)
    if threads > 1 and wait_policy_missed():
        _warn_spinning()
    return threads


@functools.cache
def _warn_spinning() -> None:
    log.warning(
        "torch's OpenMP was loaded before batchgen could set GOMP_SPINCOUNT=10000: its "
        "threads spin long while they wait, which slows each step many times over when "
        "other work runs on this machine; set GOMP_SPINCOUNT=10000 (or "
        "OMP_WAIT_POLICY=PASSIVE) in the environment, or import batchgen before torch"
    )


def eos_token_ids(path: Path, hf_config: Any, tokenizer: Any) -> tuple[int, ...]:
    """generation_config.json's EOS list, else the model config's, else the tokenizer's."""
    candidates: Any = None
    gen = path / "generation_config.json"
    if gen.is_file():
        candidates = json.loads(gen.read_text()).get("eos_token_id")
    if candidates is None:
        candidates = getattr(hf_config, "eos_token_id", None)
    if candidates is None:
        candidates = tokenizer.eos_token_id
    if candidates is None:
        return ()
    if isinstance(candidates, int):
        return (candidates,)
    return tuple(int(c) for c in candidates)


def build_engine(path: str | os.PathLike[str], config: EngineConfig) -> LoadedEngine:
    """Tokenizer, model, KV pool, CUDA graphs, pooling and runner for ``path`` as ``config`` says.

    What the config alone refuses is refused before the tokenizer and weights load."""
    root, hf, impl = _read_config(path, config)
    max_model_len = _context(root, impl, config)
    dev = pick_device(config.device)
    config.check_quantization_device(dev.type)
    group, native = None, impl.native
    if config.tensor_parallel_size > 1:
        native = _tensor_parallel_native(impl, root, config)
        if dev.type == "cuda":
            replace(config, device=str(dev)).check_visible_gpus(torch.cuda.device_count())
        group = TensorGroup.start(str(path), config, dev)  # the ranks load while this one does
    threads = set_threads(config.threads, dev, config.tensor_parallel_size)
    torch_dtype = pick_dtype(config.dtype, dev, hf.torch_dtype)
    ops = select_ops(dev, config.use_triton)
    heads = (0, 1, 0)  # (num_heads, num_kv_heads, head_dim) of the attention kernels
    if impl.native is not None:  # the kernels' limits, known from the config alone
        a = impl.native.attention
        heads = (a.num_heads, a.num_kv_heads, a.head_dim)
        _check_kernels(ops, impl.native.family, *heads, impl.native.kv_shared)
    tokenizer = _load_tokenizer(path, root)
    if group is not None:
        assert native is not None  # _tensor_parallel_native refused the transformers backend
        model: CausalLM = build_sharded_model(root, native, dev, torch_dtype, ops, max_model_len,
                                              group.shard)  # fmt: skip
        heads = _local_heads(model)
    else:
        model = _load_model(root, hf, impl, ops, dev, torch_dtype, max_model_len)
    if config.quantization is not None:
        log.info("quantization %s: %s", config.quantization, summary(model, config.quantization))
    if isinstance(model, HfCausalLM):  # transformers' model: its attention shape, once loaded
        shape = model.config
        heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    max_num_batched_tokens = config.max_num_batched_tokens or (4096 if dev.type == "cuda" else 2048)
    block_size, max_num_seqs = config.block_size, config.max_num_seqs
    try:  # the group's first collective: a rank that died while loading fails it at once
        num_kv_blocks, kv_caches = _kv_pool(
            model, config, torch_dtype, dev, None if group is None else group.collectives
        )
    except RuntimeError as exc:
        died = None if group is None else group.rank_died(exc)
        if died is None:
            raise
        raise died from exc
    eos = eos_token_ids(root, hf.hf, tokenizer)
    if ops.name == "triton":  # compiled now, not in the first steps
        _warm_up(model, kv_caches, block_size, min(max_num_batched_tokens, max_model_len), heads)
    graphs = None
    # graphs capture batchgen's own forward; transformers' modules may sync or branch on
    # values; a tensor-parallel rank's forward holds collectives the others must meet
    if (
        config.use_cuda_graphs
        and dev.type == "cuda"
        and ops.name == "triton"
        and impl.native is not None
        and group is None
    ):
        graphs = CudaGraphDecoder(
            model, kv_caches, min(max_num_seqs, 256), max_model_len, block_size, dev
        )
        graphs.capture()
    # on CPU, one thread while other processes want the CPUs (cpu_threads.py)
    contention = (
        ContentionWatch(threads, torch.set_num_threads)
        if dev.type == "cpu" and threads > 1
        else None
    )
    runner = ModelRunner(
        model, kv_caches, block_size, Sampler(eos, config.seed), dev, graphs, load_pooling(root),
        contention, group,
    )  # fmt: skip
    limits = EngineLimits(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        threads=threads,
    )
    # a cached prefix would skip the tokens a recurrent state is made of
    keeps_state = isinstance(model, HfCausalLM) and model.config.keeps_state
    return LoadedEngine(
        runner, tokenizer, limits, eos, config.enable_prefix_caching and not keeps_state
    )


def build_rank_runner(
    path: str, config: EngineConfig, rank: int, join: Callable[[torch.device], Collectives]
) -> tuple[Collectives, ModelRunner]:
    """A tensor-parallel rank other than 0 (``tensor_group.run_rank``): its shard of the
    model and of the KV pool, loaded as rank 0 loads its own, and a runner that only
    stages each step's arrays (it never samples)."""
    root, hf, impl = _read_config(path, config)
    max_model_len = _context(root, impl, config)
    native = _tensor_parallel_native(impl, root, config)
    dev = rank_device(pick_device(config.device), rank)
    collectives = join(dev)
    set_threads(config.threads, dev, config.tensor_parallel_size)
    torch_dtype = pick_dtype(config.dtype, dev, hf.torch_dtype)
    ops = select_ops(dev, config.use_triton)
    model = build_sharded_model(root, native, dev, torch_dtype, ops, max_model_len,
                                collectives.shard)  # fmt: skip
    _, kv_caches = _kv_pool(model, config, torch_dtype, dev, collectives)
    if ops.name == "triton":  # the same forwards as rank 0's warm-up, collectives and all
        max_num_batched_tokens = config.max_num_batched_tokens or 4096
        _warm_up(model, kv_caches, config.block_size,
                 min(max_num_batched_tokens, max_model_len), _local_heads(model))  # fmt: skip
    runner = ModelRunner(model, kv_caches, config.block_size, Sampler((), None), dev)
    return collectives, runner


def _tensor_parallel_native(impl: Implementation, root: Path, config: EngineConfig) -> ModelConfig:
    """The native family's config, which tensor parallelism splits; the transformers backend
    it does not."""
    if impl.native is None:
        raise UnsupportedModelError(
            f"tensor_parallel_size {config.tensor_parallel_size}: {root} runs on the transformers "
            "backend, which tensor parallelism does not split; use tensor_parallel_size 1"
        )
    check_shardable(impl.native, config.tensor_parallel_size)
    return impl.native


def _local_heads(model: CausalLM) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim) of a tensor-parallel rank's attention."""
    assert isinstance(model, ShardedDecoder)
    a = model.config.attention
    return a.num_heads, a.num_kv_heads, a.head_dim


def _kv_pool(
    model: CausalLM, config: EngineConfig, dtype: torch.dtype, dev: torch.device,
    collectives: Collectives | None,
) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:  # fmt: skip
    """The KV blocks and their pool; a tensor-parallel group's ranks hold as many blocks
    as the one with the least room (the block tables are rank 0's, for every rank)."""
    num_kv_blocks = config.num_kv_blocks or num_blocks_for_budget(
        model.config, config.block_size, dtype, dev, config.kv_cache_bytes,
        config.gpu_memory_utilization,
    )  # fmt: skip
    if collectives is not None:
        num_kv_blocks = collectives.smallest(num_kv_blocks)
    if num_kv_blocks < 1:
        raise UnsupportedModelError("no memory left for the KV cache; lower the model size")
    kv_caches = allocate_kv_cache(model.config, num_kv_blocks, config.block_size, dtype, dev)
    return num_kv_blocks, kv_caches


def _warm_up(
    model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
    max_query_len: int, heads: tuple[int, int, int],
) -> None:  # fmt: skip
    num_heads, num_kv_heads, head_dim = heads
    warm_up_prefill(model, kv_caches, block_size, max_query_len,
                    num_heads // max(num_kv_heads, 1), head_dim)  # fmt: skip


def _read_config(
    path: str | os.PathLike[str], config: EngineConfig
) -> tuple[Path, HFConfig, Implementation]:
    """The checkpoint's directory, its config, and which implementation runs it."""
    try:
        root = check_config(path)
    except ModelNotLoadable as exc:
        raise UnsupportedModelError(str(exc)) from None
    hf = read_hf_config(root)
    impl = choose_implementation(hf, config.model_impl)
    if config.quantization is not None:  # the native families' projections, quantized at load
        if impl.native is None:
            raise UnsupportedModelError(
                f"quantization {config.quantization}: {root} runs on the transformers backend, "
                "whose modules batchgen does not quantize; run it without --quantization"
            )
        impl = replace(impl, native=quantized_at_load(impl.native, config.quantization))
    return root, hf, impl


def _context(root: Path, impl: Implementation, config: EngineConfig) -> int:
    """The context: what the model supports, or less if asked."""
    limit = impl.max_positions or config.max_model_len
    if limit is None:
        raise UnsupportedModelError(
            f"{root / 'config.json'} gives no max_position_embeddings; set max_model_len"
        )
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise UnsupportedModelError(
            f"max_model_len {max_model_len} exceeds what the model supports ({limit})"
        )
    return max_model_len


def _check_kernels(
    ops: KernelOps, name: str, num_heads: int, num_kv_heads: int, head_dim: int, kv_shared: bool
) -> None:
    """Refuse an attention shape the kernels cannot run (``KernelOps.attention_limits``)."""
    problem = ops.attention_limits(num_heads, num_kv_heads, head_dim, kv_shared)
    if problem is not None:
        raise UnsupportedModelError(f"{name} on the {ops.name} kernels: {problem}")


def _load_tokenizer(path: str | os.PathLike[str], root: Path) -> PreTrainedTokenizerBase:
    """The tokenizer, once the tokenizer and weight files are known to be there."""
    from transformers import AutoTokenizer

    try:
        check_files(path, root)  # the tokenizer and weights are there, before either is read
    except ModelNotLoadable as exc:
        raise UnsupportedModelError(str(exc)) from None
    try:
        return AutoTokenizer.from_pretrained(str(root))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot load the tokenizer from {root}: {exc}") from exc


def _load_model(
    root: Path, hf: HFConfig, impl: Implementation, ops: KernelOps, dev: torch.device,
    dtype: torch.dtype, max_model_len: int,
) -> CausalLM:  # fmt: skip
    """The native family's model, or transformers' (whose attention shape is known, and
    checked against the kernels, only once it is loaded)."""
    if impl.native is not None:
        return build_model(root, impl.native, dev, dtype, ops, max_model_len)
    try:
        model = HfCausalLM.load(root, hf.hf, ops, dev, dtype)
    except UnsupportedModelError as exc:
        raise impl.refusal(exc) from exc
    shape = model.config
    _check_kernels(ops, shape.architecture, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                   shape.kv_shared)  # fmt: skip
    return model
