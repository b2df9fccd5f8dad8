"""The Triton op set: same signatures and semantics as ``batchgen.kernels.reference``.

Kernels are defined when this package is imported; to run them on the CPU
through the Triton interpreter, set TRITON_INTERPRET=1 before that import.
"""

from __future__ import annotations

from batchgen.kernels import KernelOps
from batchgen.kernels.triton.activation import silu_and_mul
from batchgen.kernels.triton.decode_attention import paged_decode_attention
from batchgen.kernels.triton.norm import fused_add_rms_norm, rms_norm
from batchgen.kernels.triton.prefill_attention import paged_prefill_attention
from batchgen.kernels.triton.rotary import apply_rotary
from batchgen.kernels.triton.store_kv import store_kv

TRITON_OPS = KernelOps(
    name="triton",
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    silu_and_mul=silu_and_mul,
    apply_rotary=apply_rotary,
    store_kv=store_kv,
    paged_decode_attention=paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention,
)

__all__ = ["TRITON_OPS"]
