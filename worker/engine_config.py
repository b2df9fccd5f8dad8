"""The engine's settings: one typed object, checked when it is made.

``Engine.from_pretrained(path, **kwargs)`` builds one from its keyword
arguments, the queue loop carries one in its own config (through JSON to its
child processes), and the CLI's flags map onto it. Torch-free, so the worker
supervisor and the CLI can build and check it without importing torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any

from batchgen.worker.worker_errors import InvalidEngineConfig

DTYPES = ("float32", "bfloat16", "float16")
# auto: batchgen's own code when it has the architecture, else transformers' modules
MODEL_IMPLS = ("auto", "native", "transformers")
# quantized at load from an unquantized checkpoint (worker/models/quant/online.py)
QUANTIZATIONS = ("fp8", "int8")
CPU_ONLY_QUANTIZATIONS = ("int8",)  # no GPU product for them yet: CUDA refuses them
_DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """device: "cuda", "cuda:N", "cpu" or None (CUDA when there is one). dtype:
    None picks float32 on CPU and the checkpoint's half type (else bfloat16)
    on CUDA. The KV pool is ``num_kv_blocks`` blocks of ``block_size`` tokens,
    or as many as fit ``kv_cache_bytes`` (CPU default 1 GiB), or on CUDA
    ``gpu_memory_utilization`` of the device. ``max_num_batched_tokens``
    bounds the tokens of one step (long prompts are prefilled in chunks;
    default 4096 on CUDA, 2048 on CPU). On CUDA the Triton kernels run
    (``use_triton=False``: the CPU path's torch ops) and decode steps replay
    CUDA graphs (``use_cuda_graphs=False`` turns that off). ``seed`` seeds
    the draws of requests without their own. ``model_impl``: "native" runs
    batchgen's own model code, "transformers" the checkpoint's transformers
    modules with batchgen's paged attention, "auto" native when batchgen has
    the architecture, else transformers. ``threads``: torch's CPU threads (and
    the C decode attention's) in this process; default: no more than torch is
    set to use (``OMP_NUM_THREADS``) and no more than the CPUs the process
    may really use, its affinity mask and cgroup quota (``cpu_threads.py``).
    Set on CPU, and on CUDA only when given. On CPU the engine runs on one
    thread while other processes compete for the CPUs (``ContentionWatch``).
    ``tensor_parallel_size``: ranks that split the model (``worker/models/
    tensor_parallel.py``): this process is rank 0 and starts the others, on
    the next GPUs from ``device``'s (CUDA) or on the CPU; a collective that
    waits longer than ``tensor_parallel_timeout_s`` takes the group down.
    ``quantization``: "fp8" quantizes a bf16/fp16/fp32 checkpoint's decoder
    projections to FP8 e4m3 as they load (per-channel weight scales, dynamic
    per-token activations; ``worker/models/quant/online.py``), "int8" to int8
    the same way, multiplied in int8 (CPU only: refused on CUDA); None runs the
    checkpoint as stored (a quantized checkpoint in its own format)."""

    device: str | None = None
    dtype: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: what the model supports
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    use_triton: bool | None = None  # default: on CUDA
    use_cuda_graphs: bool = True
    seed: int | None = None
    model_impl: str = "auto"
    threads: int | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 300.0
    quantization: str | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> EngineConfig:
        # before the generated __init__, whose TypeError names no alternative
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hint = difflib.get_close_matches(unknown[0], names, n=1)
            also = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise TypeError(
                f"unknown engine setting {unknown[0]!r}{also}; the settings are {', '.join(names)}"
            )
        return object.__new__(cls)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        for name in (
            "num_kv_blocks", "max_num_batched_tokens", "max_model_len", "kv_cache_bytes", "threads"
        ):  # fmt: skip
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("enable_prefix_caching", "use_cuda_graphs"):
            _boolean(name, getattr(self, name))
        if self.use_triton is not None:
            _boolean("use_triton", self.use_triton)
        if self.device is not None and not (
            isinstance(self.device, str) and _DEVICE.fullmatch(self.device)
        ):
            raise InvalidEngineConfig(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidEngineConfig(
                f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.model_impl not in MODEL_IMPLS:
            raise InvalidEngineConfig(
                f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidEngineConfig(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset: the "
                f"checkpoint as stored), got {self.quantization!r}"
            )
        if self.device is not None and self.device.startswith("cuda"):
            self.check_quantization_device("cuda")
        if self.quantization is not None and self.tensor_parallel_size > 1:
            raise InvalidEngineConfig(
                f"quantization {self.quantization} with tensor_parallel_size "
                f"{self.tensor_parallel_size}: tensor parallelism does not split quantized "
                "weights yet; use one of them"
            )
        utilization = self.gpu_memory_utilization
        if not (_is_number(utilization) and 0 < utilization <= 1):
            raise InvalidEngineConfig(
                f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}"
            )
        timeout = self.tensor_parallel_timeout_s
        if not (_is_number(timeout) and timeout > 0):
            raise InvalidEngineConfig(
                f"tensor_parallel_timeout_s must be a number of seconds > 0, got {timeout!r}"
            )
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 1 << 63):
            raise InvalidEngineConfig(
                f"seed must be an integer from 0 to 2**63 - 1, got {self.seed!r}"
            )

    def check_quantization_device(self, device_type: str) -> None:
        """Refuses a quantization that has no product on the device the engine runs on
        (asked for, or CUDA by default where there is one)."""
        if self.quantization in CPU_ONLY_QUANTIZATIONS and device_type != "cpu":
            raise InvalidEngineConfig(
                f"quantization {self.quantization} runs on the CPU only (int8 x int8 products "
                f"through torch._int_mm); batchgen has no {device_type.upper()} int8 product "
                "yet: run it with --device cpu, or use --quantization fp8 or no --quantization "
                "on the GPU"
            )

    def check_visible_gpus(self, visible: int) -> None:
        """For an engine on CUDA, where ``visible`` GPUs are seen: its tensor-parallel rank r
        runs on the GPU r after its device's (``tensor_group.rank_device``), so fewer GPUs
        from there on than ranks is refused before any rank starts."""
        first = int((self.device or "cuda").partition(":")[2] or 0)
        size = self.tensor_parallel_size
        if first + size > visible:
            where = f"cuda:{first} to cuda:{first + size - 1}" if size > 1 else f"cuda:{first}"
            raise InvalidEngineConfig(
                f"tensor_parallel_size {size} needs the GPUs {where}, but {visible} GPU(s) "
                "are visible"
            )

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineConfig:
        """``Engine.from_pretrained``'s keyword arguments, each a field of this class
        (an unknown one is a TypeError with a did-you-mean, as for the constructor)."""
        return cls(**kwargs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
        raise InvalidEngineConfig(f"{name} must be an integer >= 1, got {value!r}")


def _boolean(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidEngineConfig(f"{name} must be true or false, got {value!r}")
