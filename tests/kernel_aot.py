"""Compiles every Triton kernel for real GPUs (sm_80, sm_90) on a machine without one.

    python tests/kernel_aot.py      # prints one JSON object per compiled kernel variant

The wrappers are called with CPU tensors of realistic shapes while their
kernels are swapped for recorders; each recorded launch is then compiled
ahead of time with triton.compile for a CUDA target (the wheel ships ptxas),
specialised as the runtime would (16-divisible pointers and ints). That catches
what the interpreter cannot: tl.dot shape limits, constexpr misuse, type errors
in lowering, shared memory beyond the device's limit, loads that do not vectorise.
Must run without TRITON_INTERPRET (the kernels must be JIT functions).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = {80: 166912, 90: 232448}  # compute capability -> max shared memory per block (bytes)
TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}


class Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, fn: Any, launches: list[tuple[Any, tuple, dict]]):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


def record(calls: Callable[[], None]) -> list[tuple[Any, tuple, dict]]:
    import importlib

    from triton.runtime.jit import JITFunction

    from batchgen.kernels.triton import arg_checks

    launches: list[tuple[Any, tuple, dict]] = []
    arg_checks.INTERPRETED = True  # let CPU tensors past the device check: nothing runs
    arg_checks.dot_in_fp32 = lambda dtype: False  # the compiled path
    for name in (
        "store_kv",
        "decode_attention",
        "prefill_attention",
        "norm",
        "rotary",
        "activation",
    ):
        module = importlib.import_module(f"batchgen.kernels.triton.{name}")
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and attr.endswith("kernel"):
                setattr(module, attr, Recorder(value, launches))
    calls()
    return launches


def compile_launch(fn: Any, args: tuple, kwargs: dict, capability: int) -> dict[str, Any]:
    import re

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = list(args) + [kwargs[p.name] for p in fn.params[len(args) :]]
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (param, value) in enumerate(zip(fn.params, values)):
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[str(value.dtype).removeprefix("torch.")]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    ptx = kernel.asm["ptx"]
    shown = ("HEAD_DIM", "GROUP_PAD", "BLOCK_M", "TILE_N", "NUM_SPLITS", "BLOCK", "HAS_RESIDUAL")
    return {
        "kernel": fn.__name__,
        "sm": capability,
        "dtype": next(t for t in signature.values() if t.startswith("*"))[1:],  # first tensor's
        "constexprs": {k: v for k, v in constexprs.items() if k in shown},
        "shared_bytes": kernel.metadata.shared,
        "shared_limit": TARGETS[capability],
        "scalar_16bit_loads": len(re.findall(r"ld\.global\S*\.b16\b", ptx)),
        "wgmma": "wgmma" in ptx,
        "mma": "mma.sync" in ptx,
    }


def realistic_calls() -> None:
    """Each op at Llama-like shapes in bf16, attention also at head_dim 64/80 and fp32."""
    import torch

    from batchgen.kernels.triton.decode_attention import decode_attention
    from batchgen.kernels.triton.op_set import TRITON_OPS as ops

    def zeros(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    i32 = torch.int32
    for head_dim, dtype in ((128, torch.bfloat16), (80, torch.bfloat16), (64, torch.float32)):
        k_cache, v_cache = (
            zeros(8, 16, 8, head_dim, dtype=dtype),
            zeros(8, 16, 8, head_dim, dtype=dtype),
        )
        tables, lens = torch.zeros(4, 8, dtype=i32), torch.full((4,), 100, dtype=i32)
        q = zeros(4, 32, head_dim, dtype=dtype)
        for num_splits in (1, 8):
            decode_attention(q, k_cache, v_cache, tables, lens, 0.1, 128, num_splits=num_splits)
        if dtype != torch.float32:  # fp32 prefill takes ~15 s to compile; semantics are CPU-tested
            starts = torch.tensor([0, 64, 128, 192, 256], dtype=i32)
            ops.paged_prefill_attention(zeros(256, 32, head_dim), k_cache, v_cache, tables, lens, starts, 0.1, 64, 128)  # fmt: skip
        ops.store_kv(zeros(3, 8, head_dim, dtype=dtype), zeros(3, 8, head_dim, dtype=dtype), k_cache, v_cache, torch.zeros(3, dtype=torch.int64))  # fmt: skip
    ops.rms_norm(zeros(4, 4096), zeros(4096), 1e-5)
    ops.fused_add_rms_norm(zeros(4, 4096), zeros(4, 4096), zeros(4096), 1e-5)
    cos = zeros(16, 64, dtype=torch.float32)
    ops.apply_rotary(
        zeros(4, 32, 128), zeros(4, 8, 128), torch.zeros(4, dtype=torch.int64), cos, cos
    )
    ops.silu_and_mul(zeros(4, 2 * 14336))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the kernels must be JIT functions")
    for fn, args, kwargs in record(realistic_calls):
        for capability in TARGETS:
            print(json.dumps(compile_launch(fn, args, kwargs, capability)), flush=True)


if __name__ == "__main__":
    main()
