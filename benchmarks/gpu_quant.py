"""gpu_check section quant_gemm: the quantized GEMMs' correctness and TFLOP/s at Llama-3-70B layer shapes.

- correctness: the block-scaled FP8 GEMM (``w8a8_block_fp8_linear``) and the
  W4A16 GEMM (``gptq_linear``, group 128, and ``awq_linear``) against
  dequantize-then-matmul in fp32 (``quant_reference.py``) on the device, as a
  relative (Frobenius) error, bf16 activations;
- timing: ms per call and TFLOP/s (2 M N K / time) of each at the 70B
  linears (qkv 8192 -> 10240, o 8192 -> 8192, gate_up 8192 -> 57344, down
  28672 -> 8192) for 1, 16, 256 and 4096 tokens, against the device's dense
  FP8 (the FP8 GEMM) or BF16 (W4A16: its products are bf16) tensor-core peak,
  and torch's bf16 matmul of the same shape (cuBLAS) for scale. The FP8 time
  includes the activations' quantization, as a layer runs it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from benchmarks.gpu_bench import DRY_RUN, Bench

MAX_RELATIVE_ERROR = 2e-2  # bf16 output and (W4A16) bf16 weights against fp32
# Dense tensor-core peaks, TFLOP/s (NVIDIA's data sheets, without sparsity): (bf16, fp8)
PEAK_TFLOPS = {"H100 PCIe": (756.0, 1513.0), "H100": (989.0, 1979.0), "H200": (989.0, 1979.0)}


@dataclass(frozen=True)
class Layer:
    name: str
    k: int
    n: int


GPU_LAYERS = (
    Layer("qkv", 8192, 10240),
    Layer("o", 8192, 8192),
    Layer("gate_up", 8192, 57344),
    Layer("down", 28672, 8192),
)
GPU_TOKENS = (1, 16, 256, 4096)
GPU_CHECK = (37, 1024, 768)  # M, K, N
DRY_LAYERS = (Layer("tiny", 256, 64),)
DRY_TOKENS = (1, 5)
DRY_CHECK = (3, 256, 64)


def peak_tflops(device_name: str) -> tuple[float, float] | None:
    """(bf16, fp8) dense peak of a known GPU, else None (fractions then left out)."""
    for key in PEAK_TFLOPS:  # "H100 PCIe" before "H100"
        if all(word in device_name for word in key.split()):
            return PEAK_TFLOPS[key]
    return None


def fp8_weight(b: Bench, n: int, k: int) -> tuple[Any, Any]:
    """A random e4m3 weight and its (ceil(n/128), ceil(k/128)) weight_scale_inv grid."""
    torch = b.torch
    w = (b.randn(n, k, dtype=torch.float32) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-n // 128), -(-k // 128), device=b.device, generator=b.gen) * 1e-3
    return w, scale_inv


def gptq_weight(b: Bench, n: int, k: int) -> tuple[Any, ...]:
    """Random GPTQ tensors, group 128: qweight (K/8, N), qzeros (K/128, N/8), fp16 scales."""
    torch = b.torch

    def words(*shape: int) -> Any:
        return torch.randint(-(2**31), 2**31, shape, device=b.device, generator=b.gen, dtype=torch.int64).to(torch.int32)  # fmt: skip

    scales = (torch.rand(k // 128, n, device=b.device, generator=b.gen) * 1e-2).half()
    return words(k // 8, n), words(k // 128, n // 8), scales


def awq_weight(b: Bench, n: int, k: int) -> tuple[Any, ...]:
    qweight, qzeros, scales = gptq_weight(b, n, k)
    return qweight.reshape(k, n // 8), qzeros, scales  # as many words, packed along N


def quant_gemm(b: Bench) -> dict[str, Any]:
    from batchgen.kernels import quant_reference as qref
    from batchgen.kernels.triton.fp8_gemm import w8a8_block_fp8_linear
    from batchgen.kernels.triton.w4a16_gemm import awq_linear, gptq_linear

    torch = b.torch
    dry = b.shapes is DRY_RUN
    m, k, n = DRY_CHECK if dry else GPU_CHECK

    def relative_error(out: Any, expected: Any) -> dict[str, Any]:
        err = float((out.float() - expected).norm() / expected.norm())
        return {"relative_error": err, "pass": err < MAX_RELATIVE_ERROR}

    x = b.randn(m, k)
    w8, s8 = fp8_weight(b, n, k)
    qweight, qzeros, scales = gptq_weight(b, n, k)
    aw = awq_weight(b, n, k)
    checks = {
        "fp8_block": relative_error(
            w8a8_block_fp8_linear(x, w8, s8), qref.w8a8_block_fp8_linear(x, w8, s8, (128, 128))
        ),
        "gptq": relative_error(
            gptq_linear(x, qweight, qzeros, scales),
            x.float() @ qref.dequantize_gptq(qweight, qzeros, scales),
        ),
        "awq": relative_error(awq_linear(x, *aw), x.float() @ qref.dequantize_awq(*aw)),
    }
    peaks = peak_tflops(torch.cuda.get_device_name()) if b.device.type == "cuda" else None
    timings = []
    for layer in DRY_LAYERS if dry else GPU_LAYERS:
        w8, s8 = fp8_weight(b, layer.n, layer.k)
        gptq = gptq_weight(b, layer.n, layer.k)
        dense = b.randn(layer.k, layer.n)
        for tokens in DRY_TOKENS if dry else GPU_TOKENS:
            x = b.randn(tokens, layer.k)
            flops = 2 * tokens * layer.k * layer.n
            row: dict[str, Any] = {
                "layer": layer.name,
                "tokens": tokens,
                "k": layer.k,
                "n": layer.n,
            }
            for name, fn, peak in (
                ("fp8", functools.partial(w8a8_block_fp8_linear, x, w8, s8), peaks and peaks[1]),
                ("w4a16", functools.partial(gptq_linear, x, *gptq), peaks and peaks[0]),
                ("bf16_torch", functools.partial(torch.matmul, x, dense), peaks and peaks[0]),
            ):
                seconds = b.median_seconds(fn)
                row[f"{name}_ms"] = seconds * 1e3
                row[f"{name}_tflop_per_s"] = flops / seconds / 1e12
                if peak:
                    row[f"{name}_of_peak"] = flops / seconds / 1e12 / peak
            timings.append(row)
            del x
        del w8, s8, gptq, dense
    return {
        "checks": checks,
        "peak_tflops": {"bf16": peaks[0], "fp8": peaks[1]} if peaks else None,
        "timing": timings,
        "all_pass": all(c["pass"] for c in checks.values()),
    }


def table_lines(result: dict[str, Any]) -> list[str]:
    """The section's rows for gpu_check's table."""
    errs = ", ".join(
        f"{name} {'pass' if c['pass'] else 'FAIL'} {c['relative_error']:.2g}"
        for name, c in result["checks"].items()
    )
    lines = [
        f"  checks: {errs}",
        "  layer    tokens   fp8 TFLOP/s  w4a16 TFLOP/s  bf16 torch TFLOP/s",
    ]
    for r in result["timing"]:
        lines.append(
            f"  {r['layer']:8} {r['tokens']:6}  {r['fp8_tflop_per_s']:11.1f}  "
            f"{r['w4a16_tflop_per_s']:13.1f}  {r['bf16_torch_tflop_per_s']:18.1f}"
        )
    return lines
