"""The Triton op set, ``TRITON_OPS``: same signatures and semantics as ``batchgen.kernels.reference``.

Kernels are defined when this module is imported; to run them on the CPU
through the Triton interpreter, set TRITON_INTERPRET=1 before that import.
"""

from __future__ import annotations

from batchgen.kernels.ops import KernelOps, QuantGemms
from batchgen.kernels.triton import (
    activation,
    decode_attention,
    fp8_gemm,
    fused_moe,
    norm,
    prefill_attention,
    rotary,
    step,
    store_kv,
    w4a16_gemm,
)

TRITON_OPS = KernelOps(
    name="triton",
    rms_norm=norm.rms_norm,
    fused_add_rms_norm=norm.fused_add_rms_norm,
    silu_and_mul=activation.silu_and_mul,
    apply_rotary=rotary.apply_rotary,
    store_kv=store_kv.store_kv,
    paged_decode_attention=decode_attention.paged_decode_attention,
    paged_prefill_attention=prefill_attention.paged_prefill_attention,
    attention=step.TritonAttention,
    fused_moe=fused_moe.fused_moe,
    attention_limits=step.attention_limits,
    quant_gemms=QuantGemms(
        fp8_block=fp8_gemm.w8a8_block_fp8_linear,
        gptq=w4a16_gemm.gptq_linear,
        awq=w4a16_gemm.awq_linear,
        pack_quantized=w4a16_gemm.pack_quantized_linear,
    ),
)

__all__ = ["TRITON_OPS"]
