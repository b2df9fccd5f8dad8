"""The op sets: every op the model calls, as a Triton kernel and as the CPU path in torch.

The engine asks ``select_ops(device)`` once and calls the ops through the
returned ``KernelOps``: Triton on CUDA, the CPU path elsewhere. Both sets
share signatures (see ``reference.py`` for layouts and shapes); both are
tested against the plain versions: ``reference.py`` for the elementwise ops,
``dense.py`` for attention, ``moe_reference.py`` for routed experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.kernels.batch import StepAttention
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import decode as cpu_decode
from batchgen.kernels.cpu import elementwise as cpu_elementwise
from batchgen.kernels.cpu import routed_experts as cpu_routed_experts


@dataclass(frozen=True, slots=True)
class QuantGemms:
    """The GEMMs that read a quantized checkpoint's weights as stored, dequantizing a tile at a
    time on chip (``kernels/triton/fp8_gemm.py``, ``kernels/triton/w4a16_gemm.py``); each
    takes x (..., K) and the format's tensors and returns (..., N) in x's dtype."""

    # (x, weight, weight_scale_inv, block_size): block FP8, x quantized per token-group
    fp8_block: Callable[..., torch.Tensor]
    # (x, qweight, qzeros, scales, g_idx, zero_offset=1): 4-bit GPTQ
    gptq: Callable[..., torch.Tensor]
    # (x, qweight, qzeros, scales): 4-bit AWQ, GEMM packing
    awq: Callable[..., torch.Tensor]
    # (x, weight_packed, weight_scale, weight_zero_point): compressed-tensors 4-bit
    pack_quantized: Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class KernelOps:
    name: str
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    # (batch, k_cache, v_cache, AttentionKind) -> what every layer of that kind calls in the step
    attention: Callable[..., StepAttention]
    # (x, ExpertWeights, topk_weights, topk_ids) -> routed experts' weighted sum (experts.py)
    fused_moe: Callable[..., torch.Tensor]
    # (num_heads, num_kv_heads, head_dim, kv_shared) -> why the attention kernels cannot
    # take that shape, or None: checked when a model loads, not at its first step;
    # kv_shared: K and V are one tensor (MLA's latent cache)
    attention_limits: Callable[..., str | None]
    # quantized projections' products; None: they dequantize a tile at a time in torch
    # (``worker/models/quant/linear.py``), as the CPU path does
    quant_gemms: QuantGemms | None = None


CPU_OPS = KernelOps(
    name="cpu",
    rms_norm=cpu_elementwise.rms_norm,
    fused_add_rms_norm=cpu_elementwise.fused_add_rms_norm,
    silu_and_mul=cpu_elementwise.silu_and_mul,
    apply_rotary=cpu_elementwise.apply_rotary,
    store_kv=cpu_elementwise.store_kv,
    paged_decode_attention=cpu_decode.paged_decode_attention,
    paged_prefill_attention=cpu_attention.paged_prefill_attention,
    attention=cpu_attention.CpuAttention,
    fused_moe=cpu_routed_experts.fused_moe,
    attention_limits=cpu_attention.attention_limits,
)


def select_ops(device: torch.device, use_triton: bool | None = None) -> KernelOps:
    """The op set for ``device``: Triton on CUDA unless ``use_triton`` says otherwise.

    ``use_triton=True`` off CUDA runs the kernels through the Triton
    interpreter, which needs TRITON_INTERPRET=1 set before the first call (the
    kernels are defined, and triton imported, only then).
    """
    if use_triton is None:
        use_triton = device.type == "cuda"
    if not use_triton:
        return CPU_OPS
    # here, not at the top: importing the op set defines the kernels and imports triton,
    # which a CPU run never needs, and which must come after TRITON_INTERPRET is set
    from batchgen.kernels.triton.op_set import TRITON_OPS

    return TRITON_OPS
