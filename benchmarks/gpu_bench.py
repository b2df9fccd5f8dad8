"""Shapes, targets and a device-side timer shared by gpu_check's sections."""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_contexts: tuple[int, ...]
    prefill_chunks: tuple[tuple[int, int], ...]  # (context_len, q_len) per sequence
    tokens: int  # rows for norm / rotary / activation / store_kv
    hidden: int
    intermediate: int
    bw_batches: tuple[int, ...]
    bw_contexts: tuple[int, ...]
    bw_target: tuple[int, int]  # (batch, context) held to TARGET_FRACTION
    mla: tuple[int, int, int]  # DeepSeek's latent attention: (heads, kv_lora_rank, rope dim)
    copy_bytes: int
    warmup: int
    iters: int
    num_prompts: int  # engine workload
    prompt_lens: tuple[int, int]
    max_new_tokens: int


GPU = Shapes(
    32, 8, 128, 16,
    decode_contexts=(1, 17, 100, 511, 1024, 2048, 4097, 8000) * 8,
    prefill_chunks=((512, 512), (2048, 512), (1000, 1), (4096, 37), (17, 17), (300, 299)),
    tokens=4096, hidden=4096, intermediate=14336,
    bw_batches=(64, 128, 256), bw_contexts=(512, 2048, 8192), bw_target=(128, 2048),
    mla=(128, 512, 64), copy_bytes=4 << 30, warmup=3, iters=10,
    num_prompts=256, prompt_lens=(64, 512), max_new_tokens=256,
)  # fmt: skip
DRY_RUN = Shapes(
    4, 2, 16, 16,
    decode_contexts=(1, 17, 40),
    prefill_chunks=((20, 20), (33, 5), (17, 1)),
    tokens=4, hidden=32, intermediate=48,
    bw_batches=(2,), bw_contexts=(17, 40), bw_target=(2, 40),
    mla=(20, 32, 16), copy_bytes=1 << 20, warmup=1, iters=2,
    num_prompts=4, prompt_lens=(4, 16), max_new_tokens=4,
)  # fmt: skip
TARGET_FRACTION = 0.7  # of copy bandwidth, at batch 128, context 2048
TARGET_SPEEDUP = 3.0  # engine over HF continuous batching
TOLERANCE = {"bfloat16": (3e-2, 2e-2), "float16": (3e-3, 3e-3), "float32": (1e-4, 1e-4)}


class Bench:
    """Tensors on one device and a median timer (CUDA events on a GPU)."""

    def __init__(self, shapes: Shapes, device: str):
        import torch

        self.torch = torch
        self.shapes = shapes
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(0)

    def randn(self, *shape: int, dtype: Any = None) -> Any:
        dtype = dtype or self.torch.bfloat16
        return self.torch.randn(*shape, generator=self.gen, device=self.device).to(dtype)

    def paged(self, contexts, head_dim: int, dtype: Any = None):
        """Random caches, shuffled block tables and context_lens for ``contexts``."""
        torch, bs = self.torch, self.shapes.block_size
        need = [-(-c // bs) for c in contexts]
        width = max(need)
        k_cache = self.randn(sum(need) + 1, bs, self.shapes.num_kv_heads, head_dim, dtype=dtype)
        v_cache = self.randn(*k_cache.shape, dtype=dtype)
        perm = torch.randperm(k_cache.shape[0], generator=self.gen, device=self.device)
        tables = torch.zeros(len(contexts), width, dtype=torch.int32, device=self.device)
        start = 0
        for i, n in enumerate(need):
            tables[i, :n] = perm[start : start + n]
            tables[i, n:] = perm[start + n - 1]
            start += n
        lens = torch.tensor(contexts, dtype=torch.int32, device=self.device)
        return k_cache, v_cache, tables, lens

    def median_seconds(self, fn: Callable[[], Any]) -> float:
        torch = self.torch
        for _ in range(self.shapes.warmup):
            fn()
        times = []
        for _ in range(self.shapes.iters):
            if self.device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def compare(out: Any, expected: Any, dtype: str = "bfloat16") -> dict[str, Any]:
    atol, rtol = TOLERANCE[dtype]
    diff = (out.float() - expected.float()).abs()
    ok = bool((diff <= atol + rtol * expected.float().abs()).all())
    return {"max_abs_err": float(diff.max()) if diff.numel() else 0.0, "pass": ok}


def backport_interpreter_index() -> bool:
    """Let an older Triton's interpreter take a loop bound computed in the kernel.

    The interpreter holds a scalar as an array of shape (1,), and Triton before 3.7
    turns it into a Python int with ``int(array)``, which numpy 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars"): every kernel with a
    ``range(lo, hi)`` over loaded bounds failed the dry run under Triton 3.6, the lent
    GPU machine's release. Later Tritons squeeze the array first; this does the same
    for the dry run's process when the interpreter is one of the older. True if it did.
    The GPU run compiles the kernels and never reaches the interpreter.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if "int(self.handle.data))" not in inspect.getsource(original):
        return False

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
