"""Paged decode attention as a small C function, compiled at first use.

On the CPU, torch can only attend over paged K/V by first gathering each
sequence's blocks into a dense tensor (a copy of every context, every layer,
every step) and then reading that copy again. This function reads K and V
once, straight from the blocks the table names: for each sequence, the
scores of all its query heads (GQA: head h reads KV head h // group), a
softmax per head, and the weighted sum of V. fp32 throughout.

It is compiled once per process with the machine's C compiler (``$CC``,
else cc, gcc or clang) and called through ctypes, which releases the GIL.
Where there is no compiler, or the build fails, ``load()`` returns None and
the caller keeps to torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* q (S, H, D) with row/head strides, unit stride in D; k/v caches contiguous
   (num_blocks, BS, HK, D); tables (S, >= ceil(ctx / BS)) int32 rows; lens (S,)
   int32; out (S, H, D) contiguous. Returns 0, or 1 when out of memory. */
int paged_decode_attention_f32(
    const float *q, int64_t q_stride_s, int64_t q_stride_h,
    const float *k_cache, const float *v_cache,
    const int32_t *tables, int64_t table_stride, const int32_t *lens,
    float *out, int64_t S, int64_t H, int64_t HK, int64_t D, int64_t BS,
    float scale, int64_t max_len)
{
    const int64_t group = H / HK, row = HK * D; /* floats from one position to the next */
    float *scores = malloc(sizeof(float) * (size_t)(H * (max_len > 0 ? max_len : 1) + H));
    if (!scores) return 1;
    float *top = scores + H * max_len;
    for (int64_t s = 0; s < S; s++) {
        const int64_t n = lens[s];
        const int32_t *table = tables + s * table_stride;
        const float *qs = q + s * q_stride_s;
        float *o = out + s * H * D;
        for (int64_t i = 0; i < H * D; i++) o[i] = 0.f;
        if (n == 0) continue; /* a padding row attends to nothing: zeros */
        for (int64_t h = 0; h < H; h++) top[h] = -INFINITY;
        for (int64_t p = 0; p < n; p++) { /* scores: K read once, every head of a position together */
            const float *k = k_cache + ((int64_t)table[p / BS] * BS + p % BS) * row;
            for (int64_t h = 0; h < H; h++) {
                const float *qh = qs + h * q_stride_h, *kh = k + (h / group) * D;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < D; d++) dot += qh[d] * kh[d];
                dot *= scale;
                scores[h * n + p] = dot;
                if (dot > top[h]) top[h] = dot;
            }
        }
        for (int64_t h = 0; h < H; h++) { /* softmax per head */
            float sum = 0.f, *sh = scores + h * n;
            for (int64_t p = 0; p < n; p++) { sh[p] = expf(sh[p] - top[h]); sum += sh[p]; }
            const float inv = 1.f / sum;
            for (int64_t p = 0; p < n; p++) sh[p] *= inv;
        }
        for (int64_t p = 0; p < n; p++) { /* weighted sum: V read once */
            const float *v = v_cache + ((int64_t)table[p / BS] * BS + p % BS) * row;
            for (int64_t h = 0; h < H; h++) {
                const float w = scores[h * n + p], *vh = v + (h / group) * D;
                float *oh = o + h * D;
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) oh[d] += w * vh[d];
            }
        }
    }
    free(scores);
    return 0;
}
"""

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR,
             _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _I64]  # fmt: skip
# -march=native where the compiler knows it; -fopenmp-simd vectorises the
# reductions without OpenMP's runtime (torch has its own thread pool).
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp-simd"],
    ["-O3", "-fopenmp-simd"],
    ["-O2"],
)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


@functools.cache
def load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled function, or None (no compiler, or it failed: said once in the log)."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found ($CC, cc, gcc, clang): CPU decode attention uses torch")
        return None
    with tempfile.TemporaryDirectory(prefix="batchgen-kernel-") as tmp:
        source, library = Path(tmp, "paged_decode.c"), Path(tmp, "paged_decode.so")
        source.write_text(SOURCE)
        errors = ""
        for flags in _FLAG_SETS:
            cmd = [cc, *flags, "-shared", "-fPIC", str(source), "-o", str(library), "-lm"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                errors = repr(exc)
                continue
            if proc.returncode == 0:
                break
            errors = proc.stderr.strip()[-500:]
        else:
            log.warning("compiling the CPU decode kernel failed (%s); using torch", errors)
            return None
        function = ctypes.CDLL(str(library)).paged_decode_attention_f32  # stays loaded
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function


@dataclass(slots=True)
class KernelDecode:
    """One step's decode rows for the C kernel: tables and lengths as the C code reads them."""

    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, rows contiguous
    context_lens: torch.Tensor  # (num_seqs,) int32 contiguous
    max_context_len: int

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q (num_seqs, num_heads, head_dim) fp32, unit stride in head_dim -> a new (num_seqs, num_heads, head_dim)."""
        assert (
            q.dtype == torch.float32
            and q.stride(2) == 1
            and q.shape[0] == self.context_lens.shape[0]
        )
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        out = torch.empty(num_seqs, num_heads, head_dim)
        status = self.function(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            self.block_tables.data_ptr(), self.block_tables.stride(0),
            self.context_lens.data_ptr(), out.data_ptr(),
            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, self.max_context_len,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("paged decode attention: no memory for the scores")
        return out


def plan_kernel_decode(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> KernelDecode | None:
    """The step's plan for the C kernel, or None where it does not apply (not fp32
    CPU caches in the engine's contiguous layout, or no kernel). The C code
    trusts every block id and length, so they are checked here, once a step."""
    usable = (
        k_cache.dtype == torch.float32
        and k_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.dtype == torch.float32
        and v_cache.shape == k_cache.shape
    )
    function = load() if usable else None
    if function is None:
        return None
    num_blocks, block_size = k_cache.shape[:2]
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if tables.shape[0] != lens.shape[0]:
        raise ValueError(f"{tables.shape[0]} block table rows for {lens.shape[0]} context lengths")
    if lens.numel() == 0:
        return KernelDecode(function, tables, lens, 0)
    max_len = int(lens.max())
    if int(lens.min()) < 0 or max_len > tables.shape[1] * block_size:
        raise ValueError(f"context lengths must be in [0, {tables.shape[1] * block_size}]")
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(f"block ids must be in [0, {num_blocks})")
    return KernelDecode(function, tables, lens, max_len)
