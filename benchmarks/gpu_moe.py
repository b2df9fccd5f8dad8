"""gpu_check section 4: the Triton fused-MoE kernel against the per-expert loop oracle, and its speed.

For each real model's expert shapes (bf16, random weights and routing):
- correctness: relative error (Frobenius) of ``TRITON_OPS.fused_moe`` against
  ``moe_reference.fused_moe`` (fp32) at a decode-sized and a prefill-sized batch;
- timing: ms per call of the fused kernel and of the same grouped algorithm
  in plain torch (``kernels/cpu/routed_experts.py``, one matmul pair per chosen expert,
  run on the GPU), with the fused kernel's expert-weight bandwidth (bytes of
  the experts actually chosen / time: the bound at decode sizes) and TFLOP/s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from benchmarks.gpu_bench import DRY_RUN, Bench

MAX_RELATIVE_ERROR = 1e-2  # bf16 intermediates against an fp32 oracle
# the interpreter's fp32 -> bf16 casts truncate (all toward zero) instead of rounding
MAX_RELATIVE_ERROR_INTERPRETED = 3e-2


@dataclass(frozen=True)
class MoeCase:
    name: str
    hidden: int
    inter: int  # per expert
    num_experts: int
    top_k: int
    gpt_oss: bool = False  # biases and the clamped SwiGLU


GPU_CASES = (
    MoeCase("mixtral_8x7b", 4096, 14336, 8, 2),
    MoeCase("qwen3_30b_a3b", 2048, 768, 128, 8),
    MoeCase("gpt_oss_20b", 2880, 2880, 32, 4, gpt_oss=True),
    MoeCase("deepseek_v3", 7168, 2048, 256, 8),
)
GPU_CHECK_TOKENS = (7, 300)
GPU_TIME_TOKENS = (1, 32, 256, 4096)
DRY_CASES = (MoeCase("tiny", 32, 16, 4, 2), MoeCase("tiny_gpt_oss", 32, 24, 4, 2, gpt_oss=True))
DRY_CHECK_TOKENS = (3, 20)
DRY_TIME_TOKENS = (1, 5)


def moe(b: Bench) -> dict[str, Any]:
    dry = b.shapes is DRY_RUN
    cases = DRY_CASES if dry else GPU_CASES
    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case.name] = _run_case(b, case, dry)
        except Exception as exc:  # report and go on with the next model's shapes
            results[case.name] = {"pass": False, "error": repr(exc)}
    results["all_pass"] = all(r.get("pass") for r in results.values() if isinstance(r, dict))
    return results


def _run_case(b: Bench, case: MoeCase, dry: bool) -> dict[str, Any]:
    from batchgen.kernels import moe_reference
    from batchgen.kernels.cpu.routed_experts import fused_moe as grouped_torch
    from batchgen.kernels.experts import ClampedSwiGLU, ExpertWeights
    from batchgen.kernels.routing import softmax_topk
    from batchgen.kernels.triton.op_set import TRITON_OPS

    torch = b.torch
    e, h, i = case.num_experts, case.hidden, case.inter
    experts = ExpertWeights(
        w13=b.randn(e, h, 2 * i) * h**-0.5,
        w2=b.randn(e, i, h) * i**-0.5,
        b13=b.randn(e, 2 * i) * 0.1 if case.gpt_oss else None,
        b2=b.randn(e, h) * 0.1 if case.gpt_oss else None,
        activation=ClampedSwiGLU(1.702, 7.0) if case.gpt_oss else None,
    )

    def inputs(num_tokens: int):
        x = b.randn(num_tokens, h)
        logits = b.randn(num_tokens, e, dtype=torch.float32)
        return (x, experts, *softmax_topk(logits, case.top_k, renormalize=True))

    bound = MAX_RELATIVE_ERROR_INTERPRETED if dry else MAX_RELATIVE_ERROR

    def check(out: Any, args: tuple[Any, ...]) -> dict[str, Any]:
        expected = moe_reference.fused_moe(*args).float()
        err = float((out.float() - expected).norm() / expected.norm())
        return {"relative_error": err, "pass": err < bound}

    checks = {}
    for n in DRY_CHECK_TOKENS if dry else GPU_CHECK_TOKENS:
        args = inputs(n)
        checks[f"tokens_{n}"] = check(TRITON_OPS.fused_moe(*args), args)
    if b.device.type == "cuda":  # captured once, replayed after the routing changed in place
        args = inputs(GPU_CHECK_TOKENS[0])
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            TRITON_OPS.fused_moe(*args)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = TRITON_OPS.fused_moe(*args)
        fresh = inputs(GPU_CHECK_TOKENS[0])
        for old, new in zip(args[2:], fresh[2:]):
            old.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        checks["cuda_graph_replay"] = check(out, args)
    expert_bytes = 3 * h * i * experts.w13.element_size()  # w13 and w2 of one expert
    timings = []
    for n in DRY_TIME_TOKENS if dry else GPU_TIME_TOKENS:
        args = inputs(n)
        fused_s = b.median_seconds(functools.partial(TRITON_OPS.fused_moe, *args))
        torch_s = b.median_seconds(functools.partial(grouped_torch, *args))
        chosen = int(torch.unique(args[3]).numel())
        timings.append({
            "tokens": n, "experts_chosen": chosen, "fused_ms": fused_s * 1e3,
            "grouped_torch_ms": torch_s * 1e3, "speedup": torch_s / fused_s,
            "weight_gb_per_s": chosen * expert_bytes / fused_s / 1e9,
            "tflop_per_s": 2 * 3 * h * i * n * case.top_k / fused_s / 1e12,
        })  # fmt: skip
    return {
        "shape": {"hidden": h, "inter": i, "experts": e, "top_k": case.top_k},
        "checks": checks,
        "timing": timings,
        "pass": all(c["pass"] for c in checks.values()),
    }


def table_lines(section: dict[str, Any]) -> list[str]:
    """The section's rows for gpu_check's table."""
    lines = []
    for name, r in section.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            lines.append(f"  moe {name}: FAIL {r['error']}")
            continue
        errs = ", ".join(f"{c['relative_error']:.2g}" for c in r["checks"].values())
        lines.append(f"  moe {name:14} {'pass' if r['pass'] else 'FAIL'}  rel err {errs}")
        for t in r["timing"]:
            lines.append(
                f"    {t['tokens']:5} tokens  fused {t['fused_ms']:8.3f} ms  "
                f"torch {t['grouped_torch_ms']:8.3f} ms  {t['speedup']:5.1f}x  "
                f"{t['weight_gb_per_s']:6.0f} GB/s  {t['tflop_per_s']:6.1f} TFLOP/s"
            )
    return lines
