"""Compiles every Triton kernel for real GPUs (sm_80, sm_90) on a machine without one.

    python tests/kernel_aot.py      # prints one JSON object per compiled kernel variant

The wrappers are called with CPU tensors of realistic shapes while their
kernels are swapped for recorders; each recorded launch is then compiled
ahead of time with triton.compile for a CUDA target (the wheel ships ptxas),
specialised as the runtime would (16-divisible pointers and ints, ints equal
to 1 as constants), each distinct variant once. ``realistic_calls`` (the dense
model's ops) compile for sm_80 and sm_90; ``hopper_calls`` for sm_90 only: the
attention matrix of benchmarks/gpu_check.py (fp16 and bf16 x head_dim
64/128/256 x GQA 1/4/8, splits 1/8/64, prefill chunks of 1/8/512 tokens,
softcap+window, sinks+window), DeepSeek's MLA decode, clamped SwiGLU, the fused MoE (dense and gpt-oss
MXFP4) and the quantized GEMMs (FP8 block-scaled, W4A16 for GPTQ, AWQ and
compressed-tensors) at Llama-3-70B and gpt-oss shapes. That catches
what the interpreter cannot: tl.dot shape limits, constexpr misuse, type errors
in lowering, shared memory beyond the device's limit, loads that do not vectorise.
Must run without TRITON_INTERPRET (the kernels must be JIT functions).

Each object names the Triton release that compiled it. The GPU machines have an
older Triton (3.6) than the one pip gives .venv: ``make test-gpu-triton`` (part of
``make test``) runs tests/test_kernels_compile.py under it, in .venv-gpu-triton.
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
TYPES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
    "float8_e4m3fn": "fp8e4nv", "uint8": "u8",
}  # fmt: skip
KERNEL_MODULES = (
    "store_kv", "decode_attention", "prefill_attention", "norm", "rotary", "activation",
    "fused_moe", "fp8_gemm", "w4a16_gemm", "latent_decode",
)  # fmt: skip


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
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"batchgen.kernels.triton.{name}")
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and attr.endswith("kernel"):
                setattr(module, attr, Recorder(value, launches))
            elif isinstance(value, Recorder):  # recorded before: record into this list now
                value.launches = launches
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
        elif isinstance(value, int) and value == 1:  # the runtime makes a 1 a constant
            signature[param.name], constexprs[param.name] = "constexpr", 1
        elif isinstance(value, int):
            signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    ptx = kernel.asm["ptx"]
    shown = (
        "HEAD_DIM", "MAIN_DIM", "REST_DIM", "GROUP", "GROUP_PAD", "BLOCK_M", "BLOCK_N", "BLOCK_K", "TILE_N", "NUM_SPLITS", "BLOCK",
        "HAS_RESIDUAL", "SOFTCAP", "HAS_SINKS", "MXFP4", "FP8_BLOCK", "HAS_BIAS", "GROUP_N", "GROUP_K",
        "PACKED_ALONG_K", "AWQ_ORDER", "HAS_ZEROS", "ZERO_OFFSET", "HAS_G_IDX", "ONE_GROUP_PER_STEP",
    )  # fmt: skip
    return {
        "kernel": fn.__name__,
        "triton": triton.__version__,
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


def hopper_calls() -> None:
    """What the GPU machines (H100/H200) run beyond ``realistic_calls``, at real shapes."""
    import torch

    from batchgen.kernels.experts import (
        ClampedSwiGLU,
        ExpertWeights,
        Fp8BlockExpertWeights,
        Mxfp4ExpertWeights,
    )
    from batchgen.kernels.triton import fp8_gemm, w4a16_gemm
    from batchgen.kernels.triton.decode_attention import decode_attention
    from batchgen.kernels.triton.latent_decode import latent_decode_attention
    from batchgen.kernels.triton.op_set import TRITON_OPS as ops
    from batchgen.kernels.triton.prefill_attention import prefill_attention

    def empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype)  # never read: big ones cost no memory

    i32 = torch.int32
    tables, lens = torch.zeros(4, 64, dtype=i32), torch.full((4,), 1000, dtype=i32)
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in (64, 128, 256):
            # GQA 1, 4, 8 at 8 splits and 512-token chunks; splits 1/64 and chunks of 1/8 at GQA 4
            # (the group and the split count are separate constants of the kernel)
            for num_heads, num_kv_heads in ((32, 32), (32, 8), (64, 8)):
                group = num_heads // num_kv_heads
                cache = empty(8, 16, num_kv_heads, head_dim, dtype=dtype)
                q = empty(4, num_heads, head_dim, dtype=dtype)
                for num_splits in (1, 8, 64) if group == 4 else (8,):
                    decode_attention(q, cache, cache, tables, lens, 0.1, 128, num_splits=num_splits)
                for q_len in (1, 8, 512) if group == 4 else (512,):
                    starts = torch.arange(5, dtype=i32) * q_len
                    prefill_attention(empty(4 * q_len, num_heads, head_dim, dtype=dtype), cache, cache, tables, lens, starts, 0.1, q_len, 1024)  # fmt: skip
        for head_dim, options in (
            (256, {"softcap": 50.0}),
            (64, {"sinks": empty(64, dtype=dtype)}),
        ):
            cache = empty(8, 16, 8, head_dim, dtype=dtype)  # gemma-2 softcap, gpt-oss sinks
            q = empty(4, 64, head_dim, dtype=dtype)
            for num_splits in (1, 8):
                decode_attention(q, cache, cache, tables, lens, 0.1, 128, window=64, num_splits=num_splits, **options)  # fmt: skip
            starts = torch.arange(5, dtype=i32) * 32
            prefill_attention(empty(128, 64, head_dim, dtype=dtype), cache, cache, tables, lens, starts, 0.1, 32, 128, window=64, **options)  # fmt: skip
        # MLA (DeepSeek V2/V3): latent 512 + rope 64, 128 heads (one rank), splits 1 and 8
        latent = empty(8, 64, 1, 576, dtype=dtype)
        for num_splits in (1, 8):
            latent_decode_attention(empty(4, 128, 576, dtype=dtype), latent, tables, lens, 0.1, 128, num_splits=num_splits)  # fmt: skip
        ops.silu_and_mul(empty(4, 2 * 14336, dtype=dtype))
        gpt_oss = ClampedSwiGLU(alpha=1.702, limit=7.0)
        # fused MoE: Mixtral (hidden 4096, inter 14336), gpt-oss (2880, 2880, biases); 2 experts
        # of each (the count is a runtime int), 5 tokens (decode blocks) and 512 (prefill)
        for hidden, inter, act in ((4096, 14336, None), (2880, 2880, gpt_oss)):
            b13, b2 = (empty(2, 2 * inter, dtype=dtype), empty(2, hidden, dtype=dtype)) if act else (None, None)  # fmt: skip
            dense = ExpertWeights(empty(2, hidden, 2 * inter, dtype=dtype), empty(2, inter, hidden, dtype=dtype), b13, b2, activation=act)  # fmt: skip
            for tokens in (5, 512):
                ids = torch.arange(2 * tokens).remainder(2).view(tokens, 2)
                ops.fused_moe(empty(tokens, hidden, dtype=dtype), dense, empty(tokens, 2, dtype=dtype), ids)  # fmt: skip
        u8 = torch.uint8
        mxfp4 = Mxfp4ExpertWeights(
            empty(2, 5760, 90, 16, dtype=u8), empty(2, 5760, 90, dtype=u8),
            empty(2, 2880, 90, 16, dtype=u8), empty(2, 2880, 90, dtype=u8),
            empty(2, 5760, dtype=dtype), empty(2, 2880, dtype=dtype), activation=gpt_oss,
        )  # fmt: skip
        for tokens in (5, 512):
            ids = torch.arange(2 * tokens).remainder(2).view(tokens, 2)
            ops.fused_moe(empty(tokens, 2880, dtype=dtype), mxfp4, empty(tokens, 2, dtype=dtype), ids)  # fmt: skip
        # block-FP8 experts: DeepSeek-V3's (hidden 7168, inter 2048, 128 x 128 blocks)
        f8, f32 = torch.float8_e4m3fn, torch.float32
        fp8_experts = Fp8BlockExpertWeights(
            empty(2, 4096, 7168, dtype=f8), empty(2, 32, 56, dtype=f32),
            empty(2, 7168, 2048, dtype=f8), empty(2, 56, 16, dtype=f32), (128, 128),
        )  # fmt: skip
        for tokens in (5, 512):
            ids = torch.arange(2 * tokens).remainder(2).view(tokens, 2)
            ops.fused_moe(empty(tokens, 7168, dtype=dtype), fp8_experts, empty(tokens, 2, dtype=dtype), ids)  # fmt: skip
        # Llama-3-70B's linears: hidden 8192, intermediate 28672 (down_proj's K)
        for m in (1, 32, 64, 256):  # each a BLOCK_M of its own
            for k in (8192, 28672):
                scale_inv = empty(64, k // 128, dtype=torch.float32)
                fp8_gemm.w8a8_block_fp8_linear(empty(m, k, dtype=dtype), empty(8192, k, dtype=torch.float8_e4m3fn), scale_inv)  # fmt: skip
        for m in (1, 256):
            x = empty(m, 8192, dtype=dtype)
            gptq = (empty(1024, 8192, dtype=i32), empty(64, 1024, dtype=i32), empty(64, 8192, dtype=torch.float16))  # fmt: skip
            w4a16_gemm.gptq_linear(x, *gptq)
            w4a16_gemm.gptq_linear(x, *gptq, torch.zeros(8192, dtype=i32))  # act-order
            w4a16_gemm.awq_linear(x, empty(8192, 1024, dtype=i32), empty(64, 1024, dtype=i32), empty(64, 8192, dtype=torch.float16))  # fmt: skip
            packed, scale = empty(8192, 1024, dtype=i32), empty(8192, 64, dtype=dtype)
            w4a16_gemm.pack_quantized_linear(x, packed, scale)
            w4a16_gemm.pack_quantized_linear(x, packed, scale, empty(1024, 64, dtype=i32))


def launch_key(fn: Any, args: tuple, kwargs: dict) -> tuple:
    """What the runtime compiles a launch by: its kernel, dtypes, constants and 16- or 1-ness."""
    import torch

    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (str(v.dtype), v.data_ptr() % 16 == 0)
        if isinstance(v, bool) or not isinstance(v, int):
            return v if isinstance(v, (bool, str, type(None))) else type(v).__name__
        return ("int", v == 1, v % 16 == 0, abs(v) >= 2**31)

    params = {p.name: p.is_constexpr for p in fn.params}
    named = dict(zip(params, args)) | kwargs
    return (fn.__name__, tuple(
        (k, v if params.get(k, True) else spec(v)) for k, v in sorted(named.items())
    ))  # fmt: skip


JOBS: list[tuple[Any, tuple, dict, int]] = []  # (kernel, args, kwargs, capability), for the pool


def compile_job(index: int) -> dict[str, Any]:
    return compile_launch(*JOBS[index])


def main() -> None:
    import multiprocessing

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET: the kernels must be JIT functions")
    seen: set[tuple] = set()
    for calls, capabilities in ((realistic_calls, (80, 90)), (hopper_calls, (90,))):
        for fn, args, kwargs in record(calls):
            for capability in capabilities:
                key = (capability, launch_key(fn, args, kwargs))
                if key not in seen:
                    seen.add(key)
                    JOBS.append((fn, args, kwargs, capability))
    # compiles are independent: one forked worker per CPU (they inherit JOBS)
    workers = min(len(os.sched_getaffinity(0)), 8)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for result in pool.imap(compile_job, range(len(JOBS))):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
