"""Paged decode attention through the C function of ``decode_attention.c`` (built by ``native.py``).

The C code trusts every block id, length and pointer it is given; the plan
checks them once per step, before any layer calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.cpu.native import Native, load


@dataclass(slots=True)
class KernelDecode:
    """One step's decode rows for the C kernel: tables and lengths as the C code reads them."""

    native: Native
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, rows contiguous
    context_lens: torch.Tensor  # (num_seqs,) int32 contiguous
    max_context_len: int
    threads: int = 1  # the C function splits the rows over this many threads
    window: int | None = None  # a query sees only its last `window` keys
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (num_seqs, num_heads, head_dim) -> a new (num_seqs, num_heads, head_dim) of
        q's dtype; sinks (num_heads,) per-head sink logits. The C code takes q and gives
        its output in fp32 (bf16 K/V widened as read): a bf16 q is widened first and
        the output rounded back, as transformers' bf16 attention rounds its output."""
        assert q.shape[0] == self.context_lens.shape[0]
        dtype = q.dtype
        if dtype != torch.float32 or q.stride(2) != 1:
            q = q.to(torch.float32).contiguous()
        num_seqs, num_heads, head_dim = q.shape
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
            assert sinks.shape == (num_heads,) and sinks.device.type == "cpu"
        _, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty(num_seqs, num_heads, head_dim)
        status = self.native.paged_decode_attention(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16),
            self.block_tables.data_ptr(), self.block_tables.stride(0),
            self.context_lens.data_ptr(), out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, self.max_context_len,
            self.window or 0, self.softcap or 0.0,  # 0: none, as the C code reads it
            None if sinks is None else sinks.data_ptr(), self.threads,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("paged decode attention: no memory for the scores")
        return out if dtype == torch.float32 else out.to(dtype)


def plan_kernel_decode(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> KernelDecode | None:
    """The step's plan for the C kernel, or None where it does not apply (not fp32 or
    bf16 CPU caches in the engine's contiguous layout, or no kernel). The C code
    trusts every block id and length, so they are checked here, once a step."""
    usable = (
        k_cache.dtype in (torch.float32, torch.bfloat16)
        and k_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.dtype == k_cache.dtype
        and v_cache.shape == k_cache.shape
    )
    native = load() if usable else None
    if native is None:
        return None
    num_blocks, block_size = k_cache.shape[:2]
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if tables.shape[0] != lens.shape[0]:
        raise ValueError(f"{tables.shape[0]} block table rows for {lens.shape[0]} context lengths")
    if (window is not None and window < 1) or (softcap is not None and softcap <= 0):
        raise ValueError(f"window must be >= 1 and softcap > 0, got {window}, {softcap}")
    if lens.numel() == 0:
        return KernelDecode(native, tables, lens, 0, window=window, softcap=softcap)
    max_len = int(lens.max())
    if int(lens.min()) < 0 or max_len > tables.shape[1] * block_size:
        raise ValueError(f"context lengths must be in [0, {tables.shape[1] * block_size}]")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(f"block ids must be in [0, {num_blocks})")
    threads = _threads(int(lens.sum()), k_cache)
    return KernelDecode(native, tables, lens, max_len, threads, window, softcap)


# K/V floats a step's attention reads per layer below which one thread does it all:
# starting a thread (~30 us) costs more than it saves there
THREAD_MIN_FLOATS = 1 << 17


def _threads(positions: int, k_cache: torch.Tensor) -> int:
    """As many threads as torch's matmuls use, for a step with enough K/V to read."""
    floats = 2 * positions * k_cache.shape[2] * k_cache.shape[3]
    return torch.get_num_threads() if floats >= THREAD_MIN_FLOATS else 1
